"""`bench`: flags -> llmrun.bench."""

from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import (
    DEBUG,
    Activations,
    CacheType,
    Debug,
    Device,
    DraftMax,
    DraftOpt,
    Dtype,
    LookupOpt,
    Lora,
    LoraScaled,
    _adapters,
    app,
)
from llmrun.errors import UsageError

BENCH_OUTPUTS = ("json", "jsonl", "csv", "md")


@app.command("bench")
def bench_command(
    models: Annotated[
        list[str] | None,
        typer.Argument(
            help="MODEL... (default: the bundled stories260K)",
            metavar="MODEL",
            show_default=False,
        ),
    ] = None,
    n_prompt: Annotated[
        str,
        typer.Option(
            "--n-prompt", "-p", metavar="N,...", help="Prompt lengths to process (comma list)."
        ),
    ] = "512",
    n_gen: Annotated[
        str, typer.Option("--n-gen", "-n", metavar="N,...", help="Tokens to generate (comma list).")
    ] = "128",
    pg: Annotated[
        list[str] | None,
        typer.Option(
            "--pg",
            metavar="P,G",
            help="PROMPT,GEN: process, then generate, as one test (repeatable).",
        ),
    ] = None,
    n_depth: Annotated[
        str,
        typer.Option(
            "--n-depth", "-d", metavar="N,...", help="Tokens already in the KV cache (comma list)."
        ),
    ] = "0",
    repetitions: Annotated[
        int, typer.Option("--repetitions", "-r", help="Timed runs per test, after a warm-up.")
    ] = 5,
    threads: Annotated[
        str | None,
        typer.Option("--threads", "-t", metavar="N,...", help="CPU threads (comma list)."),
    ] = None,
    batch_size: Annotated[
        str,
        typer.Option(
            "--batch-size",
            "-b",
            metavar="N,...",
            help="Prompt tokens per forward pass (comma list; auto: as run feeds a prompt, 512, "
            "or fewer on the CPU for a model whose widest layer passes 16,384).",
        ),
    ] = "auto",
    device: Device = "auto",
    dtype: Dtype = "auto",
    cache_type: CacheType = None,
    activations: Activations = "f32",
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    draft: DraftOpt = None,
    draft_max: DraftMax = None,
    lookup: LookupOpt = None,
    roofline: Annotated[
        bool,
        typer.Option(
            "--roofline",
            help="Measure the machine's read bandwidth and the % of it decoding reaches.",
        ),
    ] = False,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FORMAT",
            help="json, jsonl, csv or md (default: a table, markdown in a pipe).",
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Measure prompt processing (ppN) and generation (tgN) tokens/s, like llama-bench."""
    DEBUG["on"] = debug
    if output is not None and output not in BENCH_OUTPUTS:
        raise UsageError(f"-o/--output must be one of {', '.join(BENCH_OUTPUTS)}, got {output!r}")
    from llmrun import bench

    options = bench.BenchOptions.from_flags(
        n_prompt,
        n_gen,
        pg or [],
        n_depth,
        batch_size,
        threads,
        repetitions,
        device,
        dtype,
        roofline,
        cache_type,
        activations,
        _adapters(lora, lora_scaled),
        draft=draft,
        draft_max=draft_max,
        lookup=lookup,
    )
    specs = list(models or [None])
    with ui.bench_progress(bench.total_runs(options, len(specs))) as progress:
        records = bench.benchmark(specs, options, progress)
    ui.print_bench(records, output)
