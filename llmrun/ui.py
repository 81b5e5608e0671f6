"""Everything the user sees, and the only module that uses rich.

Generated text goes to stdout as plain text (to a terminal too, so it can be
copied as is); statistics, progress and errors go to stderr, styled only when
stderr is a terminal. Nothing styled ever reaches a pipe.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def error(message: str) -> None:
    """One `error:` line on stderr."""
    if _stderr.is_terminal:
        _stderr.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    else:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()


def warn(message: str) -> None:
    if _stderr.is_terminal:
        _stderr.print(f"[yellow]warning:[/] {message}", markup=True)
    else:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def info(message: str) -> None:
    """A dim note on stderr (shown in pipes too, unstyled)."""
    if _stderr.is_terminal:
        _stderr.print(message, style="dim", markup=False)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def write(text: str) -> None:
    """Stream a piece of generated text to stdout."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def end_text() -> None:
    """Finish streamed text with a newline on a terminal (pipes get the text exactly)."""
    if stdout_is_tty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def stats_line(stats: Any) -> str:
    return (
        f"prompt: {stats.prompt_tokens} tokens ({stats.prompt_processed} processed) "
        f"in {stats.prompt_seconds:.2f} s, {stats.prompt_tps:.1f} tokens/s | "
        f"generation: {stats.completion_tokens} tokens in {stats.generation_seconds:.2f} s, "
        f"{stats.generation_tps:.1f} tokens/s"
    )


def print_stats(stats: Any) -> None:
    info(stats_line(stats))


def print_prompt(text: str) -> None:
    """The rendered prompt, on stderr, before generation."""
    if _stderr.is_terminal:
        _stderr.rule("prompt", style="dim")
        _stderr.print(text, markup=False, style="dim")
        _stderr.rule(style="dim")
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on a terminal's stderr while something slow happens; nothing in a pipe."""
    if _stderr.is_terminal:
        with _stderr.status(message, spinner="dots"):
            yield
    else:
        yield
