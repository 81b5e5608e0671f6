"""`run --batch`: the batch flags checked, then one call to llmrun.batch_run."""

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from llmrun import ui
from llmrun.cli.app import _adapters, _load, _max_tokens
from llmrun.errors import UsageError

Batch = Annotated[
    str | None,
    typer.Option(
        "--batch",
        metavar="FILE",
        help="Run each request of a JSON Lines FILE (- for stdin): one result line each.",
    ),
]
BatchLines = Annotated[
    bool,
    typer.Option("--batch-lines", help="With --batch: the file is plain text, a prompt a line."),
]
Unordered = Annotated[
    bool,
    typer.Option("--unordered", help="With --batch: write each result as it finishes."),
]
Parallel = Annotated[
    int | None,
    typer.Option("--parallel", help="With --batch: prompts decoded together (default 4)."),
]
Output = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="With --batch: write the result lines to this file."),
]
Resume = Annotated[
    bool,
    typer.Option("--resume", help="With -o: skip the ids the file holds, append the rest."),
]
Strict = Annotated[
    bool,
    typer.Option("--strict", help="With --batch: stop at a bad line instead of skipping it."),
]
BATCH_ONLY = {
    "batch_lines": "--batch-lines",
    "unordered": "--unordered",
    "parallel": "--parallel",
    "output": "--output",
    "resume": "--resume",
    "strict": "--strict",
}
# run's flags that mean nothing for a batch: its output is JSON lines already.
NOT_IN_BATCH = {
    "output_json": "--json",
    "logprobs": "--logprobs",
    "show_prompt": "--show-prompt",
    "show_thinking": "--show-thinking/--hide-thinking",
}


def check_batch_only(flags: Mapping[str, Any]) -> None:
    """Refuse the batch flags on a run without --batch."""
    for name, flag in BATCH_ONLY.items():
        if flags[name] not in (None, False):
            raise UsageError(f"{flag} goes with --batch")


def run_batch(flags: Mapping[str, Any]) -> None:
    """`run --batch FILE` with the rest of run's flags (`flags`: the command's locals)."""
    from llmrun import batch_run

    for name, flag in NOT_IN_BATCH.items():
        if flags[name] not in (None, False):
            raise UsageError(f"{flag} does not go with --batch (it writes JSON lines)")
    args = list(flags["args"] or [])
    if len(args) > 1 or (args and flags["model"] is not None):
        raise UsageError("--batch reads its prompts from FILE: give no prompt argument")
    if flags["resume"] and flags["output"] is None:
        raise UsageError("--resume needs -o FILE (the results to continue)")
    parallel = 4 if flags["parallel"] is None else flags["parallel"]
    if parallel < 1:
        raise UsageError(f"--parallel must be positive, got {parallel}")
    if flags["raw"] and (flags["think"] is not None or flags["reasoning_effort"] is not None):
        raise UsageError(
            "--think/--no-think and --reasoning-effort need the chat template: drop --raw"
        )
    limit = _max_tokens(flags["max_tokens"])
    data = _read_input(flags["batch"])
    if flags["output"] is not None:
        _check_output(flags["output"])
    engine = _load(
        flags["model"] or (args[0] if args else None),
        device=flags["device"],
        dtype=flags["dtype"],
        ctx_size=flags["ctx_size"],
        threads=flags["threads"],
        template_file=flags["template"],
        cache_type=flags["cache_type"],
        activations=flags["activations"],
        lora=_adapters(flags["lora"], flags["lora_scaled"]),
    )
    grammar = None
    if flags["output_format"] is not None or flags["grammar"] is not None:
        from llmrun import structured

        grammar = structured.for_cli(engine, flags["output_format"], flags["grammar"])
    options = batch_run.Options(
        engine.sampling(flags),
        limit,
        flags["stop"] or (),
        flags["raw"],
        engine.switches(flags["think"], flags["reasoning_effort"]),
    )
    failures = batch_run.run_file(
        engine,
        data,
        options,
        flags["output"],
        plain=flags["batch_lines"],
        resume=flags["resume"],
        parallel=parallel,
        ordered=not flags["unordered"],
        strict=flags["strict"],
        grammar=grammar,
        on_failure=lambda e: ui.error(str(e)),
        progress=lambda total: ui.batch_progress(
            total, flags["verbose"], flags["output"] is None and ui.stdout_is_tty()
        ),
    )
    if failures:
        raise typer.Exit(1)  # each bad line has had its `error:` line


def _read_input(source: str) -> bytes:
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("--batch - reads the requests from stdin: pipe them in")
        return sys.stdin.buffer.read()
    try:
        return Path(source).expanduser().read_bytes()
    except OSError as e:
        raise UsageError(f"--batch {source}: {e.strerror or e}") from None


def _check_output(path: Path) -> None:
    """Refuse an -o FILE that cannot be written before the model loads and the lines are
    read (it came after both, and after an error line for each bad line)."""
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise UsageError(f"-o {path}: {e.strerror or e}") from None
    if not existed:
        path.unlink()  # a run that fails before its first result leaves no empty file
