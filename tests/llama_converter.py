"""llama.cpp's converter (convert_hf_to_gguf.py, fetched beside its conversion/ and
gguf-py/) run for the tests from one warm process per test worker.

Its imports (torch, transformers, its own gguf-py) take ~5 s of a conversion's ~6 s on
2 cores, and the suite converts a few dozen tiny folders. A server process imports them
once and forks a child for each request: the child starts with them done, and what a
request's patch changes in the converter's classes dies with it.
"""

from __future__ import annotations

import atexit
import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from helpers import CONVERTER

# The converter's vocabulary step picks a BPE vocabulary by its pre-tokenizer's hash, and
# does not know the tests' stories260K tokenizer: told it is llama-bpe's.
TINY_VOCAB = "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'llama-bpe'\n"

# argv: the converter. A request is one JSON line {"patch", "runs", "log"}: a child runs
# `patch` (Python; `base` is conversion.base) then the converter once per argument list
# in "runs", its stdout and stderr in the file "log"; the reply is its exit status.
_SERVER = r"""
import json, os, runpy, sys, traceback
from pathlib import Path
converter = Path(sys.argv[1])
sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
import conversion.base as base
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        status = 0
        try:
            exec(request["patch"], dict(globals()))
            for args in request["runs"]:
                sys.argv = [str(converter), *args]
                runpy.run_path(str(converter), run_name="__main__")
        except SystemExit as exit:
            if isinstance(exit.code, int):
                status = exit.code
            elif exit.code is not None:  # sys.exit("why"): said, and status 1
                print(exit.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@functools.cache
def _server() -> tuple[subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="llama-converter-", suffix=".log")[1])
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(CONVERTER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )

    def stop() -> None:
        server.stdin.close()
        server.wait()
        log.unlink(missing_ok=True)

    atexit.register(stop)
    return server, log


def convert(runs: Sequence[Sequence[str]], patch: str = "") -> None:
    """The converter run once per command line in `runs` (its arguments: a folder,
    --outfile, --outtype, --mmproj, ...), all in one child that first runs `patch`
    (Python; `base` is conversion.base). Fails the test with the converter's output
    when it fails."""
    server, server_log = _server()
    with tempfile.NamedTemporaryFile(prefix="llama-converter-", suffix=".log") as log:
        request = {"patch": patch, "runs": [list(map(str, run)) for run in runs], "log": log.name}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        assert reply, f"llama.cpp's converter server ended:\n{server_log.read_text()[-3000:]}"
        output = Path(log.name).read_text(errors="replace")
    assert int(reply) == 0, f"llama.cpp's converter failed:\n{output[-3000:]}"


def run_converter(folder: Path, outputs: dict[Path, str], patch: str = "") -> None:
    """The converter on a tiny test `folder` into each output file, with its flags
    ("--outtype f32 --mmproj"), its vocabulary step told the tiny tokenizer is llama-bpe's
    (TINY_VOCAB); `patch`: Python run before it (`base` is conversion.base)."""
    runs = [[str(folder), "--outfile", str(out), *flags.split()] for out, flags in outputs.items()]
    convert(runs, TINY_VOCAB + patch)
