"""What the hub tests share: repo names, a Progress that records, cache paths, and a way
to run a pull in a subprocess (the fixtures are in conftest.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from llmrun import hub

GGUF_REPO = "test/tiny-GGUF"
ST_REPO = "test/tiny-llama"
ST_PULLED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
PULL_SCRIPT = """
import sys
from llmrun import hub
from llmrun.errors import LlmrunError
try:
    print(hub.pull(sys.argv[1]))
except LlmrunError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


class Recorder:
    """A Progress that remembers what it was told."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self.started: list[tuple[list[hub.FileTransfer], int]] = []
        self.last: dict[str, tuple[int, int]] = {}
        self.done: list[str] = []

    def on_notice(self, message: str) -> None:
        self.notices.append(message)

    def on_start(self, files: list[hub.FileTransfer], total_bytes: int) -> None:
        self.started.append((files, total_bytes))

    def on_progress(self, name: str, done: int, total: int) -> None:
        self.last[name] = (done, total)

    def on_file_done(self, name: str) -> None:
        self.done.append(name)


def cache(repo: str) -> Path:
    return Path(os.environ["LLMRUN_HOME"]) / "models" / ("models--" + repo.replace("/", "--"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_pull(name: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PULL_SCRIPT, name],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_for_part(repo: str, at_least: int, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for part in (cache(repo) / "blobs").glob("*.part"):
            if part.stat().st_size >= at_least:
                return part
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the download never started")
