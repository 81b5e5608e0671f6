"""The `llmrun` command line: flags -> options -> library calls.

The one place where LlmrunError becomes an `error:` line and an exit code
(0 ok, 1 error, 2 usage, 130 interrupted). torch and the model code are
imported inside the commands, so `llmrun --help` stays instant. app.py holds the
Typer app and the options commands share; each other module registers a few
commands on it, in the order `llmrun --help` lists them.
"""

from __future__ import annotations

import errno
import sys

import typer

from llmrun import threads, ui  # noqa: F401  (threads: its first CPU reading, before torch loads)
from llmrun.cli import preload, process  # noqa: F401  (preload: gguf without mistral_common, first)
from llmrun.cli.app import DEBUG, app
from llmrun.errors import LlmrunError

# Importing a command module registers its commands, in the order `--help` lists them.
# isort: off
from llmrun.cli import generate, embed, rerank, models, bench, perplexity, serve  # noqa: F401
from llmrun.cli import quantize, imatrix  # noqa: F401
# isort: on

__all__ = ["app", "main"]

_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EBADF, errno.EFBIG}


def _is_usage_error(e: Exception) -> bool:
    # typer >= 0.20 vendors click, so its UsageError is not click's; match by shape.
    return any(cls.__name__ == "UsageError" for cls in type(e).__mro__) and hasattr(
        e, "format_message"
    )


def main() -> None:
    """Console entry point: run the app, turn errors into one line and an exit code."""
    process.tune()
    if sys.stdout is None:  # started with stdout closed (`llmrun ... >&-`)
        ui.error("standard output is closed")
        sys.exit(1)
    try:
        code = app(prog_name="llmrun", standalone_mode=False)
    except LlmrunError as e:
        if DEBUG["on"]:
            raise
        ui.error(str(e))
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        if sys.stderr.isatty():
            sys.stderr.write("\n")  # the shell's prompt goes after the ^C, not beside it
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`llmrun run ... | head`): not an error.
        sys.stderr.close()
        sys.exit(0)
    except SystemExit as e:
        # typer answers a broken pipe itself, with exit status 1: the same case as above.
        if e.code == 1 and isinstance(e.__context__, BrokenPipeError):
            sys.exit(0)
        raise
    except OSError as e:  # output that cannot be written (a full disk), a file unread
        if DEBUG["on"]:
            raise
        where = e.filename or ("cannot write the output" if e.errno in _WRITE_ERRORS else None)
        ui.error(f"{where}: {e.strerror or e}" if where else str(e.strerror or e))
        sys.exit(1)
    except Exception as e:
        if not _is_usage_error(e) or DEBUG["on"]:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":
            print(e.format_message())
            sys.exit(0)
        message = e.format_message()
        ui.error(message[:1].lower() + message[1:])
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
