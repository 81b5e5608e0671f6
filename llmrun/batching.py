"""Continuous batching: concurrent requests decoded together by one scheduler thread.

The thread owns the model and one KV cache with a row per slot. Each step it
admits waiting requests into free slots, prefills up to PREFILL_BUDGET of their
prompt tokens (the chunks of several requests in one padded forward; a long
prompt takes several steps, so it delays the others by one chunk at a time),
then advances every decoding sequence by one token in a single batched forward,
each row at its own position. Each sequence samples with its own Sampler and
becomes text through its own TokenStream, as stream_generate does for one, so
its tokens do not depend on what it was batched with (float rounding aside:
batched logits differ from single-row ones by ~1e-5). Finished and cancelled
sequences leave between steps. Events reach the caller through a callback on
the scheduler thread; it must return quickly.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmrun.api import Engine
from llmrun.errors import LlmrunError, ServerBusyError
from llmrun.generate import KVState, Response, Stats, TokenStream, check_fits, prefill
from llmrun.sampling import Sampler, SamplingParams

# Prompt tokens prefilled per step: smaller than a one-shot run's chunk, since
# every decoding sequence waits for it.
PREFILL_BUDGET = 128

Event = Response | Exception


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None
    ignore_eos: bool = False


@dataclass(eq=False)
class Job:
    """A request in the scheduler: waiting, then in a slot, then finished."""

    request: Request
    on_event: Callable[[Event], None]
    slot: int | None = None
    state: KVState | None = None
    sampler: Sampler | None = None
    stream: TokenStream | None = None
    history: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    cancelled: bool = False
    finished: bool = False

    @property
    def prefilling(self) -> bool:
        return self.state is not None and len(self.state.tokens) < len(self.request.prompt)


class Scheduler:
    """`parallel` slots decoded together; up to `queue` more requests wait for one."""

    def __init__(
        self,
        engine: Engine,
        parallel: int = 4,
        queue: int = 64,
        prefill_budget: int = PREFILL_BUDGET,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be positive, got {parallel}")
        self.engine = engine
        self.parallel = parallel
        self.queue_size = queue
        self.prefill_budget = prefill_budget
        self.cache = engine.new_cache(parallel, engine.ctx_size)
        self.free = list(range(parallel))
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # touched by the scheduler thread only
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llmrun-scheduler", daemon=True)

    @property
    def capacity(self) -> int:
        return self.engine.ctx_size

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop after the current step; unfinished requests get an error event."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        gone = ServerBusyError("the server is shutting down")
        for job in [*self.waiting, *self.active]:
            self._finish(job, gone)
        self.waiting.clear()

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Job:
        """Queue a request; raises ContextOverflowError for a prompt that does not
        fit and ServerBusyError when the queue is full."""
        if not request.prompt:
            raise LlmrunError("the prompt is empty")
        check_fits(len(request.prompt), self.capacity)
        job = Job(request, on_event)
        if request.max_tokens is not None and request.max_tokens <= 0:
            stats = Stats(prompt_tokens=len(request.prompt))
            self._finish(job, Response("", None, stats, finish_reason="length"))
            return job
        with self._cond:
            if self._closed:
                raise ServerBusyError("the server is shutting down")
            if len(self.waiting) >= self.queue_size + len(self.free):
                raise ServerBusyError(
                    f"all {self.parallel} slots are busy and {len(self.waiting)} requests are waiting"
                )
            self.waiting.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a request (its client went away); its slot is free at the next step."""
        with self._cond:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
            self._cond.notify()

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._closed or self.waiting or self.active):
                        self._cond.wait()
                    if self._closed:
                        return
                    self._admit()
                try:
                    self._step()
                except Exception as e:  # a bug fails the requests in flight, not the scheduler
                    for job in list(self.active):
                        self._finish(job, e)

    def _admit(self) -> None:
        """Under the lock: let go of cancelled sequences, then fill free slots."""
        for job in [j for j in self.active if j.cancelled]:
            job.finished = True
            self._release(job)
        while self.free and self.waiting:
            job = self.waiting.popleft()
            request = job.request
            try:
                job.sampler = Sampler(request.params)
                job.stream = TokenStream(
                    self.engine.tokenizer,
                    request.prompt,
                    Stats(prompt_tokens=len(request.prompt), prompt_processed=len(request.prompt)),
                    request.max_tokens,
                    () if request.ignore_eos else self.engine.eos_ids,
                    request.stop,
                    request.logprobs,
                )
            except Exception as e:
                self._finish(job, e)
                continue
            job.slot = min(self.free)
            self.free.remove(job.slot)
            job.state = KVState(self.cache.select([job.slot]))
            job.history = list(request.prompt)
            self.active.append(job)

    def _step(self) -> None:
        model = self.engine.model
        parts, budget = [], self.prefill_budget
        for job in self.active:
            if budget <= 0:
                break
            if job.prefilling and not job.cancelled:
                done = len(job.state.tokens)
                # Chunks start at multiples of the budget, so they are the same however busy the server is.
                parts.append((job, job.request.prompt[done : done + self.prefill_budget]))
                budget -= len(parts[-1][1])
        if parts:
            self._prefill(parts)
        decoding = sorted(
            (j for j in self.active if j.next_token is not None and not j.cancelled),
            key=lambda j: j.slot,
        )
        if not decoding:
            return
        device = self.cache.k.device
        ids = torch.tensor([[j.next_token] for j in decoding], device=device)
        positions = torch.tensor([[len(j.state.tokens)] for j in decoding], device=device)
        try:
            logits = model(ids, positions, self.cache.select([j.slot for j in decoding]))
        except Exception as e:
            for job in decoding:
                self._finish(job, e)
            return
        for row, job in enumerate(decoding):
            job.state.tokens.append(job.next_token)
            try:
                self._advance(job, logits[row, -1])
            except Exception as e:
                self._finish(job, e)

    def _prefill(self, parts: list[tuple[Job, list[int]]]) -> None:
        """Feed each job its chunk; a job whose prompt is then complete gets its first token."""
        model = self.engine.model
        try:
            if len(parts) == 1:
                job, part = parts[0]
                logits = prefill(model, job.state, part, self.prefill_budget)[None]
            else:
                logits = self._prefill_together(parts)
        except Exception as e:  # a failed forward fails its requests, not the server
            for job, _ in parts:
                self._finish(job, e)
            return
        for (job, _), row in zip(parts, logits, strict=True):
            if not job.prefilling:
                try:
                    self._advance(job, row)
                except Exception as e:
                    self._finish(job, e)

    def _prefill_together(self, parts: list[tuple[Job, list[int]]]) -> torch.Tensor:
        """One forward for several chunks, rows padded on the right: a padded key
        lies past its row's real tokens, so no real query sees it, and it is
        overwritten before that position is ever attended to."""
        width = max(len(part) for _, part in parts)
        top = self.capacity - 1  # real positions stay below it (check_fits)
        ids, positions = [], []
        for job, part in parts:
            start = len(job.state.tokens)
            ids.append(part + [part[-1]] * (width - len(part)))
            positions.append([min(start + i, top) for i in range(width)])
        device = self.cache.k.device
        last = torch.tensor([len(part) - 1 for _, part in parts], device=device)
        logits = self.engine.model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            self.cache.select([job.slot for job, _ in parts]),
            last=last,
        )
        for job, part in parts:
            job.state.tokens.extend(part)
        return logits[:, -1]

    def _advance(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the job's next token from its logits and pass on the text it makes."""
        token = job.sampler(logits, job.history)
        job.history.append(token)
        response = job.stream.add(token, logits)
        if response is not None:
            self._send(job, response)
        if job.stream.done or len(job.state.tokens) >= job.state.capacity:
            self._finish(job, job.stream.close())
        else:
            job.next_token = token

    def _send(self, job: Job, event: Event) -> None:
        try:
            job.on_event(event)
        except Exception:  # nobody is listening any more
            job.cancelled = True

    def _finish(self, job: Job, event: Event) -> None:
        if job.finished:
            return
        job.finished = True
        job.next_token = None
        if job.slot is not None:
            with self._cond:
                self._release(job)
        self._send(job, event)

    def _release(self, job: Job) -> None:
        if job in self.active:
            self.active.remove(job)
            self.free.append(job.slot)
