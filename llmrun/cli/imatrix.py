"""`imatrix`: an importance matrix of a GGUF model over a text, as llama-imatrix computes
it, for `llmrun quantize --imatrix`."""

import time
from pathlib import Path
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, Debug, Device, Dtype, Threads, _load, app
from llmrun.cli.perplexity import _error, _text
from llmrun.errors import UsageError


@app.command()
def imatrix(
    model: Annotated[
        str, typer.Argument(help="MODEL: a .gguf file or a Hub name.", metavar="MODEL")
    ],
    file: Annotated[
        Path,
        typer.Option("--file", "-f", help="The text to run the model over.", metavar="FILE"),
    ],
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="The imatrix file to write.", metavar="FILE"),
    ] = Path("imatrix.gguf"),
    chunk_size: Annotated[
        int, typer.Option("--chunk-size", "-c", help="Tokens per chunk (llama-imatrix's -c).")
    ] = 512,
    chunks: Annotated[
        int | None,
        typer.Option("--chunks", help="Run at most this many chunks (-1: all, the default)."),
    ] = None,
    process_output: Annotated[
        bool,
        typer.Option("--process-output", help="Collect output.weight's activations too."),
    ] = False,
    output_format: Annotated[
        str | None,
        typer.Option(
            "--output-format",
            help="gguf (llama.cpp's GGUF imatrix, the default) or dat (the legacy format).",
        ),
    ] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    debug: Debug = False,
) -> None:
    """Compute an importance matrix as llama-imatrix does: the sums of squared activations
    going into each weight matrix over chunks of a text, with each chunk's perplexity."""
    DEBUG["on"] = debug
    from llmrun import imatrix as im
    from llmrun import perplexity as ppl

    if output_format is not None and output_format not in im.FORMATS:
        raise UsageError(f"--output-format must be gguf or dat, got {output_format!r}")
    if chunk_size < ppl.MIN_CTX:
        raise UsageError(f"--chunk-size must be at least {ppl.MIN_CTX}, got {chunk_size}")
    limit = None if chunks is None or chunks == -1 else chunks
    if limit is not None and limit < 1:
        raise UsageError(f"--chunks must be positive or -1 (all), got {chunks}")
    output = output.expanduser()
    if output.is_dir():
        raise UsageError(f"{output}: is a directory; give the imatrix file's name")
    if not output.parent.is_dir():
        raise UsageError(f"{output.parent}: no such directory for the output")
    if output_format is None and output.suffix != ".gguf":
        ui.warn(
            f"{output}: writing the GGUF format under a name not ending in .gguf "
            "(--output-format dat writes the legacy format)"
        )
    text = _text(file)
    engine = _load(model, ctx_size=chunk_size, device=device, dtype=dtype, threads=threads)
    gg = engine.checkpoint.gguf
    if gg is None:
        raise UsageError(
            f"{engine.name}: llmrun imatrix takes a GGUF model (the matrix is keyed by its "
            "tensor names); convert it to GGUF first"
        )
    tokens = ppl.tokenize(engine.tokenizer, text)
    if len(tokens) < 2 * chunk_size:
        raise UsageError(
            f"the text is {len(tokens)} tokens long; chunks of {chunk_size} tokens need at "
            f"least {2 * chunk_size}: give a longer text or a smaller --chunk-size"
        )
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    chunked = ppl.chunk(tokens, chunk_size, limit, bos)
    model_type = engine.checkpoint.config["model_type"]
    collector = im.Collector(im.targets(engine.model, gg, model_type, process_output))
    if not collector.targets:
        raise UsageError(f"{engine.name}: no weight matrix of the model to collect")
    tensors = len({t.name for t in collector.targets})
    ui.info(f"imatrix: {len(chunked)} chunks of {chunk_size} tokens, {tensors} tensors")
    start, last = time.perf_counter(), None
    for last in im.collect(engine.model, engine.new_cache, chunked, collector):
        ui.write(f"[{last.chunks}]{last.ppl:.4f},")
    ui.write(f"\nFinal estimate: PPL = {last.ppl:.4f} +/- {_error(last.error, 5)}\n")
    counts = [int(c.max()) for c in collector.counts.values()]
    result = collector.imatrix([str(file)], max(counts, default=0) // chunk_size, chunk_size)
    for name, entry in result.entries.items():
        unused = int((entry.counts == 0).sum())
        if unused:
            ui.warn(
                f"{name}: {unused} of {len(entry.counts)} experts took no token of the text "
                "(their importance is taken as 1)"
            )
    im.write(result, output, output_format or "gguf")
    ui.info(
        f"wrote {output}: {len(result.entries)} entries over {result.chunk_count} chunks "
        f"in {time.perf_counter() - start:.2f} s"
    )
