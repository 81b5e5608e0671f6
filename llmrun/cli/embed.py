"""`embed`: texts -> one embedding vector each, as JSON."""

import json
import sys
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, CtxSize, Debug, Device, Dtype, Threads, _load, app
from llmrun.errors import UsageError
from llmrun.loading.embedding import POOLINGS


@app.command()
def embed(
    model: Annotated[
        str, typer.Argument(help="MODEL: .gguf file, HF directory or Hub name.", metavar="MODEL")
    ],
    texts: Annotated[
        list[str] | None,
        typer.Argument(help="[TEXT]... (default: one text per line of stdin)", show_default=False),
    ] = None,
    pooling: Annotated[
        str | None,
        typer.Option(
            help=f"{', '.join(POOLINGS)}: how a text's token states become one vector "
            "(default: the model's own).",
        ),
    ] = None,
    no_normalize: Annotated[
        bool, typer.Option("--no-normalize", help="Keep the raw vectors (default: unit length).")
    ] = False,
    truncate: Annotated[
        bool,
        typer.Option("--truncate", help="Cut texts longer than the context (default: an error)."),
    ] = False,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", help="Texts per forward pass (default: 32).")
    ] = None,
    output_json: Annotated[
        bool,
        typer.Option("--json", help="Print one OpenAI-shaped object (data, model, usage)."),
    ] = False,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    debug: Debug = False,
) -> None:
    """Print an embedding vector of each TEXT (or stdin line): one JSON array per line."""
    DEBUG["on"] = debug
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if pooling is not None and pooling not in POOLINGS:
        raise UsageError(f"unknown --pooling {pooling!r} (choose from {', '.join(POOLINGS)})")
    if not texts:
        texts = _stdin_lines()
    engine = _load(
        model, device=device, dtype=dtype, ctx_size=ctx_size, threads=threads, generate=False
    )
    from llmrun.embeddings import DEFAULT_BATCH_SIZE

    result = engine.embed(
        texts, pooling, not no_normalize, batch_size or DEFAULT_BATCH_SIZE, truncate
    )
    vectors = result.vectors.tolist()
    if output_json:
        ui.print_json(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": i, "embedding": vector}
                    for i, vector in enumerate(vectors)
                ],
                "model": model,
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "total_tokens": result.prompt_tokens,
                },
            }
        )
        return
    sys.stdout.write("".join(json.dumps(vector) + "\n" for vector in vectors))


def _stdin_lines() -> list[str]:
    """The texts piped on stdin, one a line (without a last empty line)."""
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(
            "no text: give texts as arguments (llmrun embed MODEL TEXT...) or pipe them"
        )
    lines = sys.stdin.read().split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        raise UsageError("no text: stdin was empty")
    return lines
