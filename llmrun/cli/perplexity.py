"""`perplexity`: a text's perplexity under a model, and the KL-divergence of a model from
a base model's saved log-probabilities, printed as llama-perplexity prints them."""

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from llmrun import ui
from llmrun.cli.app import (
    DEBUG,
    Activations,
    CacheType,
    Debug,
    Device,
    Dtype,
    Threads,
    _load,
    app,
)
from llmrun.errors import UsageError


@app.command()
def perplexity(
    model: Annotated[
        str, typer.Argument(help="MODEL: .gguf file, HF directory or Hub name.", metavar="MODEL")
    ],
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="The text to measure (default: stdin).", metavar="FILE"),
    ] = None,
    ctx_size: Annotated[
        int | None,
        typer.Option(
            "--ctx-size",
            "-c",
            help="Tokens per chunk (default: 512; with --kl-divergence the base's).",
        ),
    ] = None,
    chunks: Annotated[
        int | None,
        typer.Option("--chunks", help="Evaluate at most this many chunks (-1: all, the default)."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            "-b",
            help="Tokens per forward pass (default: 512); a multiple of the context "
            "evaluates that many chunks together.",
        ),
    ] = None,
    kl_divergence_base: Annotated[
        Path | None,
        typer.Option(
            "--kl-divergence-base",
            metavar="FILE",
            help="Save the model's log-probabilities to FILE (with --kl-divergence: compare "
            "with those saved there).",
        ),
    ] = None,
    kl_divergence: Annotated[
        bool,
        typer.Option(
            "--kl-divergence",
            help="Compare the model with the base model's log-probabilities "
            "(--kl-divergence-base FILE), on the base's tokens: KL divergence, top token, "
            "PPL ratio.",
        ),
    ] = False,
    output_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object of the results instead.")
    ] = False,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    cache_type: CacheType = None,
    activations: Activations = "f32",
    debug: Debug = False,
) -> None:
    """Measure perplexity over a text as llama-perplexity does: chunks of --ctx-size
    tokens, each from an empty cache, the second half of each scored."""
    DEBUG["on"] = debug
    from llmrun import kl_divergence as kld
    from llmrun import perplexity as ppl

    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    limit = None if chunks is None or chunks == -1 else chunks
    if limit is not None and limit < 1:
        raise UsageError(f"--chunks must be positive or -1 (all), got {chunks}")
    if ctx_size is not None:
        ppl.check_ctx(ctx_size)
    batch = batch_size or ppl.DEFAULT_BATCH
    options = dict(
        device=device, dtype=dtype, threads=threads, cache_type=cache_type, activations=activations
    )
    if kl_divergence:
        if kl_divergence_base is None:
            raise UsageError(
                "--kl-divergence needs --kl-divergence-base FILE (the base model's "
                "log-probabilities, saved by a run without --kl-divergence)"
            )
        if file is not None:
            raise UsageError(
                "--kl-divergence reads its tokens from the --kl-divergence-base file: leave out -f"
            )
        ctx = kld.base_ctx(kl_divergence_base)
        if ctx_size is not None and ctx_size != ctx:
            raise UsageError(
                f"{kl_divergence_base} was computed with a context of {ctx}, not {ctx_size}"
            )
        engine = _load(model, ctx_size=ctx, **options)
        base = kld.read_base(kl_divergence_base, engine.tokenizer)
        _warn_past_training(engine, ctx)
        start = time.perf_counter()
        steps = kld.compare(engine.model, engine.new_cache, base, limit, batch)
        _print_divergence(engine.name, base, steps, output_json, start)
        return
    text = _text(file)
    ctx = ctx_size or ppl.DEFAULT_CTX
    engine = _load(model, ctx_size=ctx, **options)
    chunked = ppl.text_chunks(engine.tokenizer, text, ctx, limit)
    _warn_past_training(engine, ctx)
    if not output_json:
        ui.info(
            f"perplexity: {len(chunked)} chunks of {ctx} tokens, the last "
            f"{ctx - 1 - ctx // 2} of each scored"
        )
    start = time.perf_counter()
    if kl_divergence_base is not None:
        estimates = kld.save_base(
            engine.model,
            engine.new_cache,
            engine.tokenizer,
            chunked,
            kl_divergence_base,
            engine.name,
            batch,
        )
    else:
        estimates = ppl.measure(engine.model, engine.new_cache, chunked, batch)
    _print_perplexity(engine.name, ctx, estimates, output_json, start)


def _text(file: Path | None) -> str:
    """The text of FILE, or of stdin, without one last newline (llama.cpp's -f drops it)."""
    if file is None and (sys.stdin is None or sys.stdin.isatty()):
        raise UsageError("no text: give a file with -f FILE or pipe the text in")
    source = "stdin" if file is None else f"-f {file}"
    try:
        data = sys.stdin.buffer.read() if file is None else file.expanduser().read_bytes()
        text = data.decode("utf-8")
    except OSError as e:
        raise UsageError(f"{source}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{source}: not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise UsageError(f"no text: {source} is empty")
    return text


def _warn_past_training(engine: Any, ctx: int) -> None:
    trained = engine.checkpoint.config.get("max_position_embeddings")
    if isinstance(trained, int) and ctx > trained:
        ui.warn(f"the model was trained on only {trained} context tokens ({ctx} given)")


def _error(value: float | None, digits: int) -> str:
    return "nan" if value is None else f"{value:.{digits}f}"


def _print_perplexity(name: str, ctx: int, estimates: Any, output_json: bool, start: float) -> None:
    """llama-perplexity's running estimate per chunk ([1]5.1234,[2]...) and its final line;
    with --json one object at the end."""
    running, last = [], None
    for last in estimates:
        running.append(last.ppl)
        if not output_json:
            ui.write(f"[{last.chunks}]{last.ppl:.4f},")
    seconds = time.perf_counter() - start
    if output_json:
        ui.print_json(
            {
                "model": name,
                "ctx_size": ctx,
                "chunks": last.chunks,
                "tokens": last.tokens,
                "ppl": last.ppl,
                "ppl_error": last.error,
                "running_ppl": running,
                "seconds": round(seconds, 3),
            }
        )
        return
    ui.write(f"\nFinal estimate: PPL = {last.ppl:.4f} +/- {_error(last.error, 5)}\n")
    ui.info(f"{last.tokens} tokens scored in {seconds:.2f} s")


def _print_divergence(name: str, base: Any, steps: Any, output_json: bool, start: float) -> None:
    """llama-perplexity's per-chunk table of the comparison, then its three tables of
    statistics (PPL, KL divergence, token probability); with --json one object."""
    step = None
    if not output_json:
        ui.write(
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
            "              Δp RMS            Same top p\n"
        )
    for step in steps:
        if output_json:
            continue
        r = step.divergence.running()
        ui.write(
            f"{step.chunks:4d}    {r['ppl']:9.4f} ± {r['ppl_error']:9.4f}"
            f"    {r['ln_ppl_ratio']:10.5f} ± {r['ln_ppl_ratio_error']:10.5f}"
            f"    {r['kld']:10.5f} ± {r['kld_error']:10.5f}"
            f"    {100 * r['rms_delta_p']:6.3f} ± {100 * r['rms_delta_p_error']:6.3f} %"
            f"    {100 * r['same_top_p']:6.3f} ± {100 * r['same_top_p_error']:6.3f} %\n"
        )
    summary = step.divergence.summary()
    if output_json:
        ui.print_json(
            {
                "model": name,
                "base": str(base.path),
                "base_model": base.model,
                "ctx_size": base.ctx,
                "chunks": step.chunks,
                **summary,
                "seconds": round(time.perf_counter() - start, 3),
            }
        )
        return
    s, k, p = summary, summary["kld"], summary["delta_p"]
    correlation = s["ln_ppl_correlation"]
    lines = [
        "",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_error']:10.6f}",
        f"Mean PPL(base)                : {s['base_ppl']:10.6f} ± {s['base_ppl_error']:10.6f}",
        "Cor(ln(PPL(Q)), ln(PPL(base))): "
        + ("nan" if correlation is None else f"{100 * correlation:6.2f}%"),
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_error']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_error']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_difference']:10.6f} ± {s['ppl_difference_error']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {k['mean']:10.6f} ± {k['error']:10.6f}",
        f"Maximum KLD: {k['max']:10.6f}",
        *(f"{key:>5}   KLD: {k[key]:10.6f}" for key in ("99.9%", "99.0%", "95.0%", "90.0%")),
        f"Median  KLD: {k['median']:10.6f}",
        *(f"{key:>5}   KLD: {k[key]:10.6f}" for key in ("10.0%", "5.0%", "1.0%", "0.1%")),
        f"Minimum KLD: {k['min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * p['mean']:6.3f} ± {100 * p['error']:5.3f} %",
        f"Maximum Δp: {100 * p['max']:6.3f}%",
        *(
            f"{key:>5}   Δp: {100 * p[key]:6.3f}%"
            for key in ("99.9%", "99.0%", "95.0%", "90.0%", "75.0%")
        ),
        f"Median  Δp: {100 * p['median']:6.3f}%",
        *(
            f"{key:>5}   Δp: {100 * p[key]:6.3f}%"
            for key in ("25.0%", "10.0%", "5.0%", "1.0%", "0.1%")
        ),
        f"Minimum Δp: {100 * p['min']:6.3f}%",
        f"RMS Δp    : {100 * p['rms']:6.3f} ± {100 * p['rms_error']:5.3f} %",
        f"Same top p: {100 * s['same_top_p']:6.3f} ± {100 * s['same_top_p_error']:5.3f} %",
    ]
    ui.write("\n".join(lines) + "\n")
