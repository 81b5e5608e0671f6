"""One request at a time, for a model off the batching scheduler: a text-to-text model
(T5, llmrun.text_to_text), whose decoder attends to each request's own encoding, which the
scheduler's batched decoder-only forward has no place for. `Serial` takes the scheduler's
submit and cancel (service.Generation drives either); each request generates through
Engine.generate in a thread of its own, one after the other in the order they arrive (as
Whisper's transcriptions run one at a time, llmrun.server.transcriptions). A later task may
batch them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from llmrun import api
from llmrun.batching import Event, Request
from llmrun.server.schema import ApiError


@dataclass(eq=False)
class SerialJob:
    request: Request
    on_event: Callable[[Event], None]
    cancelled: bool = False


class Serial:
    """Runs `engine`'s requests one at a time, first come first served."""

    def __init__(self, engine: api.Engine) -> None:
        self.engine = engine
        self.order = threading.Condition()
        self.next = self.arrived = 0  # tickets: the next to run, the next to hand out

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> SerialJob:
        """Start `request` (it runs once those before it are done); what it cannot do is
        a 400, raised here."""
        refused = {
            "ignore_eos": request.ignore_eos,
            "echo with logprobs": request.prompt_logprobs is not None,
            "images": request.images is not None,
            "lora": request.lora is not None,
        }
        for name, asked in refused.items():
            if asked:
                raise ApiError(
                    400, f"{name}: {self.engine.name} (T5, text-to-text) does not take it"
                )
        job = SerialJob(request, on_event)
        with self.order:
            ticket, self.arrived = self.arrived, self.arrived + 1
        threading.Thread(
            target=self._run, args=(job, ticket), name="llmrun-serial", daemon=True
        ).start()
        return job

    def cancel(self, job: SerialJob) -> None:
        job.cancelled = True

    def _run(self, job: SerialJob, ticket: int) -> None:
        with self.order:
            self.order.wait_for(lambda: self.next == ticket)
        try:
            if not job.cancelled:
                self._generate(job)
        finally:
            with self.order:
                self.next += 1
                self.order.notify_all()

    def _generate(self, job: SerialJob) -> None:
        r = job.request
        try:
            stream = self.engine.generate(r.prompt, r.params, r.max_tokens, r.stop, r.logprobs)
            for response in stream:
                if job.cancelled:  # the client went away: stop decoding
                    stream.close()
                    return
                job.on_event(response)
        except Exception as e:  # carried to the request, as the scheduler carries its errors
            job.on_event(e)
