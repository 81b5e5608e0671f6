"""`llmrun serve` as a real server in a subprocess, for tests that drive it over HTTP."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx


class Server:
    """`llmrun serve --port 0 ARGS` in a subprocess; its log goes to a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if k != "LLMRUN_API_KEY"}
        command = [sys.executable, "-m", "llmrun", "serve", "--port", "0", "--threads", "1"]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [*command, *args], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.url = self._wait_for_url()
        deadline = time.monotonic() + 120
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.log.read_text())
            if found:
                return found.group(1)
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(self.log.read_text())

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        labels = "" if "{" in name else r"(?:\{[^}]*\})?"
        pattern = rf"^{re.escape(name)}{labels} (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))
