"""One request at a time, for a model off the batching scheduler: a text-to-text model
(T5, llmrun.text_to_text), whose decoder attends to each request's own encoding, which the
scheduler's batched decoder-only forward has no place for. `Serial` takes the scheduler's
submit and cancel (service.Generation drives either); each request generates through
Engine.generate in a thread of its own, one after the other in the order they arrive (as
Whisper's transcriptions run one at a time, llmrun.server.transcriptions). A later task may
batch them. A request's num_beams, source_language and target_language (extensions of the
completion endpoints' bodies: options_of) choose its beams and languages. With beams, a
request's n choices are the best n hypotheses of one search: the first of them to run
searches, and the others take their replies from it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

from llmrun import api
from llmrun.batching import Event, Request
from llmrun.errors import LlmrunError
from llmrun.generate import Response
from llmrun.sampling import SamplingParams
from llmrun.server.schema import ApiError, as_api_error
from llmrun.text_to_text import Options

FIELDS = ("num_beams", "source_language", "target_language")


def options_of(engine: api.Engine, fields: object) -> Options | None:
    """The beams and languages a request's body (or ollama's `options`) asks for in its
    FIELDS: None where it gives none; a 400 for a model that is not text-to-text."""
    values = {name: getattr(fields, name, None) for name in FIELDS}
    given = [name for name, value in values.items() if value is not None]
    if not given:
        return None
    if not engine.text_to_text:
        raise ApiError(
            400,
            f"{given[0]}: only a text-to-text model (T5, BART, Marian, M2M100, ...) takes "
            f"it, not {engine.name}",
            param=given[0],
        )
    return Options(**values)


def choice_options(
    engine: api.Engine,
    params: SamplingParams,
    logprobs: int | None,
    options: Options | None,
    n: int,
) -> list[Options | None]:
    """The options of each of a request's `n` choices: with beams, choice j is the search's
    j-th best finished hypothesis (transformers' num_return_sequences), so `n` may not
    exceed num_beams (a 400); else every choice decodes as the request asks."""
    if n == 1 or not engine.text_to_text:
        return [options] * n
    try:
        beams = engine.text_to_text_plan(params, logprobs, options).beams.num_beams
    except LlmrunError as e:
        raise as_api_error(e) from None
    if beams == 1:
        return [options] * n
    if n > beams:
        raise ApiError(
            400,
            f"n: {n} choices, and a beam search of {beams} beams finishes {beams} hypotheses; "
            f"ask for up to {beams}, or for more beams",
            param="n",
        )
    return [dataclasses.replace(options or Options(), hypothesis=j) for j in range(n)]


@dataclass(eq=False)
class Search:
    """A beam search that a request's choices share: each finished hypothesis's replies,
    best first, once one of them has run it."""

    replies: list[list[Response]] | None = None


@dataclass(eq=False)
class SerialJob:
    request: Request
    on_event: Callable[[Event], None]
    search: Search | None = None  # a beam search's, shared by the request's choices
    cancelled: bool = False


class Serial:
    """Runs `engine`'s requests one at a time, first come first served."""

    def __init__(self, engine: api.Engine) -> None:
        self.engine = engine
        self.order = threading.Condition()
        self.next = self.arrived = 0  # tickets: the next to run, the next to hand out
        self.search = Search()  # the last beam search submitted: its choices after the first

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> SerialJob:
        """Start `request` (it runs once those before it are done); what it cannot do is
        a 400, raised here."""
        refused = {
            "ignore_eos": request.ignore_eos,
            "echo with logprobs": request.prompt_logprobs is not None,
            # images go to a model whose image encoder is loaded (T5Gemma 2's encoder takes
            # them; Florence-2's and TrOCR's come framed by their processors), not audio
            "images": request.images is not None and self.engine.vision is None,
            "lora": request.lora is not None,
        }
        for name, asked in refused.items():
            if asked:
                raise ApiError(
                    400, f"{name}: {self.engine.name} (an encoder-decoder) does not take it"
                )
        try:  # beams and languages it cannot take are a 400 before anything runs
            plan = self.engine.text_to_text_plan(
                request.params, request.logprobs, request.text_to_text
            )
        except LlmrunError as e:
            raise as_api_error(e) from None
        search = None
        if plan.beams.num_beams > 1:
            # choice_options numbers a request's choices 0, 1, ..., submitted in turn
            if plan.hypothesis == 0:
                self.search = Search()
            search = self.search
        job = SerialJob(request, on_event, search)
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
        if job.search is not None:
            self._choose(job)
            return
        r = job.request
        try:
            stream = self.engine.generate(
                r.prompt,
                r.params,
                r.max_tokens,
                r.stop,
                r.logprobs,
                images=r.images,
                options=r.text_to_text,
            )
            for response in stream:
                if job.cancelled:  # the client went away: stop decoding
                    stream.close()
                    return
                job.on_event(response)
        except Exception as e:  # carried to the request, as the scheduler carries its errors
            job.on_event(e)

    def _choose(self, job: SerialJob) -> None:
        """A beam search's reply for job's choice: its search's, run now unless another
        choice of the request ran it."""
        r, search = job.request, job.search
        options = r.text_to_text or Options()
        try:
            if search.replies is None:
                every = dataclasses.replace(options, hypothesis=None)
                stream = self.engine.generate(
                    r.prompt, r.params, r.max_tokens, r.stop, r.logprobs, images=r.images,
                    options=every,
                )  # fmt: skip
                replies: list[list[Response]] = [[]]
                for response in stream:  # one reply after another, each ending with its final
                    replies[-1].append(response)
                    if response.finish_reason is not None:
                        replies.append([])
                search.replies = replies[:-1]
            for response in search.replies[options.hypothesis]:
                if job.cancelled:
                    return
                job.on_event(response)
        except Exception as e:
            job.on_event(e)
