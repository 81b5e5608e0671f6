"""`python -m llmrun ARGS` run inside the test process, for the many tests that check
what a command prints rather than what the process boundary does: a subprocess costs an
interpreter start and a torch import (seconds each on a busy CI machine), this costs
the command alone. It calls the same entry point (llmrun.cli.main, so errors become the
same `error:` line and exit code) with pipe-like standard streams, and gives back the
subprocess.CompletedProcess that `subprocess.run(..., capture_output=True, text=True)`
would. What only a real process shows stays with subprocesses: environment variables
read at import (LLMRUN_NATIVE, OMP_NUM_THREADS), signals, a closed or full stdout, a
terminal, tracebacks of uncaught errors (here they propagate and fail the test)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import warnings

import torch

from llmrun.cli import main
from llmrun.cli.app import DEBUG

# A fresh interpreter's warning filters, which `python -m llmrun` runs under (pytest's
# own would record the warnings rather than print them).
_FRESH_INTERPRETER_IGNORES = (
    DeprecationWarning,
    PendingDeprecationWarning,
    ImportWarning,
    ResourceWarning,
)


def _warn_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _pipe_text(raw: bytes) -> str:
    # subprocess's text mode: the locale's UTF-8, universal newlines.
    return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def llmrun(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """`llmrun ARGS` with `input` on stdin (else an empty pipe), run in this process; its
    exit status, stdout and stderr (warnings included, as a fresh interpreter shows
    them). The state a command may change (torch's threads and grad mode, warning
    filters, the SIGINT handler, --debug) is put back afterwards."""
    argv = ["llmrun", *map(str, args)]
    stdout, stderr = io.BytesIO(), io.BytesIO()
    saved_streams = sys.argv, sys.stdin, sys.stdout, sys.stderr
    saved_torch = torch.get_num_threads(), torch.is_grad_enabled()
    saved_sigint, saved_debug = signal.getsignal(signal.SIGINT), DEBUG["on"]
    # Held here until the values are read: a dropped wrapper closes its BytesIO.
    streams = (
        # A POSIX sys.stdin splits lines at "\n" and keeps a "\r" before it.
        io.TextIOWrapper(io.BytesIO((input or "").encode()), encoding="utf-8", newline="\n"),
        io.TextIOWrapper(stdout, encoding="utf-8", write_through=True),
        io.TextIOWrapper(stderr, encoding="utf-8", errors="backslashreplace", write_through=True),
    )
    sys.argv = argv
    sys.stdin, sys.stdout, sys.stderr = streams
    code: int | str | None = 0
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in _FRESH_INTERPRETER_IGNORES:
                warnings.simplefilter("ignore", category, append=True)
            warnings.showwarning = _warn_on_stderr
            main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved_streams
        torch.set_num_threads(saved_torch[0])
        torch.set_grad_enabled(saved_torch[1])
        signal.signal(signal.SIGINT, saved_sigint)
        DEBUG["on"] = saved_debug
    if isinstance(code, str):  # sys.exit("message"): printed, status 1
        stderr.write(code.encode() + b"\n")
        code = 1
    return subprocess.CompletedProcess(
        argv, code or 0, _pipe_text(stdout.getvalue()), _pipe_text(stderr.getvalue())
    )
