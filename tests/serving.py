"""`llmrun serve` as a real server in a subprocess, for tests that drive it over HTTP, or
its app in process over a started Service; images as requests send them, and the
single-sequence reply serve's must equal; a scheduler's replies to requests decoded
together."""

import base64
import dataclasses
import hashlib
import os
import queue
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from llmrun.batching import Request
from llmrun.images import open_image
from llmrun.sampling import SamplingParams
from llmrun.server import Service, create_app

GREEDY = SamplingParams(temperature=0)


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


def served(engine, name: str) -> Iterator[TestClient]:
    """A TestClient on serve's app over a started Service of `engine` named `name` (2
    requests decoded together, 4 queued), the Service closed after; a module fixture
    yields from it."""
    service = Service(name, set(), None, parallel=2, queue=4)
    service.start(engine)
    try:
        with TestClient(create_app(service)) as http:
            yield http
    finally:
        service.close()


def data_url(image: bytes) -> str:
    """An image's bytes (PNG) as a request's base64 data: URL."""
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_content(*parts) -> list[dict]:
    """Chat content parts: a text for a str, an image_url data: URL for bytes."""
    return [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else {"type": "image_url", "image_url": {"url": data_url(part)}}
        for part in parts
    ]


def chat_reply(client, *parts, max_tokens: int = 8) -> dict:
    """A greedy /v1/chat/completions reply to one user message of `parts` (image_content)."""
    body = {
        "messages": [{"role": "user", "content": image_content(*parts)}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def image_prompt(engine, *parts):
    """What `llmrun run --image` feeds the model for a user message of these parts: its
    text, ids, PromptImages, and each image's digest (as serve names them)."""
    template_parts = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    text = engine.render([{"role": "user", "content": template_parts}])
    pictures = [p for p in parts if isinstance(p, bytes)]
    ids, prompt_images = engine.image_prompt(text, [open_image(p) for p in pictures])
    return text, ids, prompt_images, [hashlib.sha256(p).digest() for p in pictures]


def alone(engine, *parts, max_tokens: int = 8, ignore_eos: bool = False) -> tuple[str, list[int]]:
    """The single-sequence loop's greedy reply to image_prompt: its text and tokens."""
    _, ids, prompt_images, _ = image_prompt(engine, *parts)
    if ignore_eos:
        engine = dataclasses.replace(engine, eos_ids=[])
    responses = list(engine.generate(ids, GREEDY, max_tokens, images=prompt_images))
    return "".join(r.text for r in responses), [r.token for r in responses if r.token is not None]


def image_request(engine, *parts, max_tokens: int = 8, **options) -> Request:
    """A greedy llmrun.batching.Request of image_prompt, its images named by their digests
    (as serve sends it to the scheduler); `options`: Request's own."""
    _, ids, prompt_images, digests = image_prompt(engine, *parts)
    return Request(ids, GREEDY, max_tokens, images=prompt_images, image_digests=digests, **options)


def scheduled(scheduler, requests) -> list[tuple[str, list[int]]]:
    """Each llmrun.batching.Request's text and tokens, all submitted before the scheduler
    starts, so they are admitted and decoded together."""
    queues = [queue.Queue() for _ in requests]
    for request, events in zip(requests, queues, strict=True):
        scheduler.submit(request, events.put)
    scheduler.start()
    out = []
    try:
        for events in queues:
            pieces, tokens = [], []
            while True:
                event = events.get(timeout=300)
                if isinstance(event, Exception):
                    raise event
                pieces.append(event.text)
                tokens += [event.token] if event.token is not None else []
                if event.finish_reason is not None:
                    break
            out.append(("".join(pieces), tokens))
    finally:
        scheduler.close()
    return out
