"""`rerank`: a query and documents -> the documents by a cross-encoder's relevance score."""

import sys
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, CtxSize, Debug, Device, Dtype, Threads, _load, app
from llmrun.errors import UsageError


@app.command()
def rerank(
    model: Annotated[
        str, typer.Argument(help="MODEL: .gguf file, HF directory or Hub name.", metavar="MODEL")
    ],
    query: Annotated[str, typer.Argument(help="QUERY: what the documents are ranked for.")],
    documents: Annotated[
        list[str] | None,
        typer.Argument(
            help="[DOCUMENT]... (default: one document per line of stdin)", show_default=False
        ),
    ] = None,
    top_n: Annotated[
        int | None,
        typer.Option("--top-n", min=1, help="Print the N best documents (default: all)."),
    ] = None,
    sigmoid: Annotated[
        bool,
        typer.Option(
            "--sigmoid",
            help="Scores through the logistic function, in (0, 1), as sentence-transformers' "
            "CrossEncoder and vLLM give them (default: the raw logit, as llama.cpp).",
        ),
    ] = False,
    truncate: Annotated[
        bool,
        typer.Option(
            "--truncate", help="Cut documents whose pair passes the context (default: an error)."
        ),
    ] = False,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", help="Pairs per forward pass (default: 32).")
    ] = None,
    output_json: Annotated[
        bool,
        typer.Option("--json", help="Print one rerank API object (results, model, usage)."),
    ] = False,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    debug: Debug = False,
) -> None:
    """Print the DOCUMENTs (or stdin lines) by relevance to QUERY, best first: index,
    score and document, tab-separated."""
    DEBUG["on"] = debug
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if not documents:
        documents = _stdin_lines()
    engine = _load(
        model, device=device, dtype=dtype, ctx_size=ctx_size, threads=threads, generate=False
    )
    from llmrun import reranking

    if sigmoid and engine.checkpoint.rank_head is not None:
        raise UsageError("--sigmoid: this reranker's scores are probabilities already")
    result = engine.rerank(query, documents, batch_size or reranking.DEFAULT_BATCH_SIZE, truncate)
    if sigmoid:
        result.scores = reranking.sigmoid(result.scores)
    ranked = result.ranked(top_n)
    if output_json:
        ui.print_json(
            {
                "object": "list",
                "model": model,
                "results": [{"index": r.index, "relevance_score": r.score} for r in ranked],
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "total_tokens": result.prompt_tokens,
                },
            }
        )
        return
    sys.stdout.write("".join(f"{r.index}\t{r.score:.6f}\t{documents[r.index]}\n" for r in ranked))


def _stdin_lines() -> list[str]:
    """The documents piped on stdin, one a line (without a last empty line)."""
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(
            "no document: give documents as arguments (llmrun rerank MODEL QUERY DOCUMENT...) "
            "or pipe them, one a line"
        )
    lines = sys.stdin.read().split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        raise UsageError("no document: stdin was empty")
    return lines
