"""The service behind serve's endpoints: the scheduler's owner, a request's admission
(body size, JSON, auth, sampling), and its events carried from the scheduler thread into
the event loop, as one whole reply or server-sent events."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, RootModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request

from llmrun import api, batching, native
from llmrun.batching import Event, Job, Scheduler
from llmrun.generate import Response as GenResponse
from llmrun.sampling import SamplingParams
from llmrun.server.audio import AudioEncoder
from llmrun.server.images import ImageEncoder
from llmrun.server.metrics import Metrics
from llmrun.server.reply import tool_format
from llmrun.server.schema import (
    ApiError,
    Sampling,
    as_api_error,
    busy_error,
    validation_message,
)
from llmrun.server.serial import Serial
from llmrun.tool_calls import ToolFormat

MAX_BODY_BYTES = 4 << 20
# A body that may carry base64 images (chat's, responses'): this much in all, of which
# MAX_BODY_BYTES besides the images' URLs (llmrun.server.images.check_body).
MAX_IMAGE_BODY_BYTES = 50 << 20
LOG = logging.getLogger("uvicorn.error")


# --- the service ----------------------------------------------------------------------


class Service:
    """What the endpoints share: the model once it is loaded, the scheduler, metrics."""

    def __init__(
        self,
        model_id: str,
        aliases: set[str],
        api_key: str | None,
        parallel: int,
        queue: int,
        kv_memory: int | None = None,
        prefix_cache: bool = True,
        pooling: str | None = None,
    ) -> None:
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.api_key = api_key
        self.parallel = parallel
        self.queue = queue
        self.kv_memory, self.prefix_cache = kv_memory, prefix_cache
        self.created = int(time.time())
        self.engine: api.Engine | None = None
        self.scheduler: Scheduler | None = None
        self.serial: Serial | None = None  # a text-to-text model's runner (no scheduler)
        self.load_error: BaseException | None = None
        self.tool_format: ToolFormat | None = None  # the calls the model's template teaches
        self.metrics = Metrics(self)
        self.pooling = pooling  # serve's --pooling for /v1/embeddings (None: the model's)
        # One embedding forward at a time, beside the scheduler's (each takes every core).
        self.embed_lock = threading.Lock()
        self.image_encoder = ImageEncoder()  # requests' images (llmrun.server.images)
        self.audio_encoder = AudioEncoder()  # requests' audio (llmrun.server.audio)

    def start(self, engine: api.Engine) -> None:
        """Serve `engine`: a model that generates through the scheduler, a text-to-text
        model (T5, BART, Marian, ...) one request at a time (llmrun.server.serial), an embedding model
        (/v1/embeddings alone) without either."""
        # Build the native kernels now, while /health says loading, rather than in the
        # first request (a first build takes seconds).
        native.available()
        if engine.text_to_text:
            self.engine, self.serial = engine, Serial(engine)
            return
        if not engine.generates:
            self.engine = engine
            return
        scheduler = Scheduler(
            engine,
            self.parallel,
            self.queue,
            kv_memory=self.kv_memory,
            prefix_cache=self.prefix_cache,
        )
        scheduler.start()
        self.tool_format = tool_format(engine)
        self.engine, self.scheduler = engine, scheduler

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, given = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "missing or incorrect API key: send `Authorization: Bearer KEY` (or "
                "`x-api-key: KEY`)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def ready_engine(self, model: str | None) -> api.Engine:
        if model is not None and model not in self.names:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )
        if self.engine is None:
            raise busy_error("the model is still loading")
        return self.engine


async def read_json(request: Request, schema: type[BaseModel], limit: int = MAX_BODY_BYTES) -> Any:
    """The body, at most `limit` bytes (its size kept as request.state.body_bytes), as
    `schema`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    request.state.body_bytes = len(body)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict) and not issubclass(schema, RootModel):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None


async def begin(
    request: Request, schema: type[Sampling], limit: int = MAX_BODY_BYTES
) -> tuple[Service, Any, api.Engine]:
    """The checks every generation request passes: key, body (at most `limit` bytes), a
    model that generates."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, schema, limit)
    return service, body, generating_engine(service, body.model)


def generating_engine(service: Service, model: str | None) -> api.Engine:
    """The engine a request naming `model` gets, which must generate."""
    engine = service.ready_engine(model)
    if not engine.generates:
        use = (
            "a reranker; use /v1/rerank"
            if engine.reranks
            else f"a speech recognition model ({engine.speech_family}); use "
            "/v1/audio/transcriptions"
            if engine.transcribes
            else "an embedding model; use /v1/embeddings"
        )
        raise ApiError(
            400, f"{service.model_id} is {use}", param="model", code="model_not_supported"
        )
    return engine


def sampling_of(engine: api.Engine, body: Sampling) -> tuple[Any, list[str]]:
    params = engine.defaults.updated(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logit_bias=_logit_bias(engine, body.logit_bias),
    )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return params, stop


def choices_of(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of a request's `n` choices: with a seed, choice j draws with seed + j,
    so the choices differ and the request still repeats."""
    if params.seed is None:
        return [params] * n
    return [params.updated(seed=params.seed + j) for j in range(n)]


def _logit_bias(engine: api.Engine, bias: dict[str, float] | None) -> tuple | None:
    """OpenAI's {"token id": bias} as SamplingParams takes it, each id checked."""
    if not bias:
        return None
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < engine.tokenizer.vocab_size):
            raise ApiError(
                400,
                f"logit_bias: {key!r} is not a token id of this model (0 to "
                f"{engine.tokenizer.vocab_size - 1})",
                param="logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(pairs)


# How often a reply that is not streamed asks whether its client is still there (a
# streamed one learns it when a write fails).
DISCONNECT_CHECK = 0.25
# How long a stream may take to end after the server is told to exit (less than uvicorn's
# graceful shutdown timeout).
SHUTDOWN_GRACE = 3.0


class Generation:
    """One HTTP request's sequences (one per prompt and choice of `n`), their events
    carried from the scheduler thread into the event loop, with latencies recorded as
    tokens arrive. Events come as (sequence index, response)."""

    def __init__(
        self,
        service: Service,
        endpoint: str,
        requests: list[batching.Request],
        arrived: float,
    ) -> None:
        self.service, self.endpoint, self.arrived = service, endpoint, arrived
        self.metrics = service.metrics
        self.last_token_at: list[float | None] = [None] * len(requests)
        self.counted = [0] * len(requests)  # tokens already added to the generation counter
        self.finals: list[GenResponse | None] = [None] * len(requests)
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def deliver(index: int, event: Event) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        room = service.parallel + service.queue
        if len(requests) > room:
            raise ApiError(
                400,
                f"the request asks for {len(requests)} sequences (prompts times n), but the "
                f"server runs {service.parallel} at once and queues {service.queue} more "
                "(serve's --parallel and --queue)",
                param="n",
            )
        self.jobs: list[Job] = []
        # The scheduler, or a text-to-text model's one-at-a-time runner.
        self.runner = service.scheduler if service.scheduler is not None else service.serial
        try:
            for index, request in enumerate(requests):
                self.jobs.append(self.runner.submit(request, partial(deliver, index)))
        except BaseException:
            self._cancel_unfinished()
            raise

    @property
    def done(self) -> bool:
        return all(final is not None for final in self.finals)

    async def events(
        self, disconnected: Callable | None = None
    ) -> AsyncIterator[tuple[int, GenResponse]]:
        """Every sequence's responses up to and including its final one. Leaving early
        (the client went away, or `disconnected()` says so: asked every DISCONNECT_CHECK
        seconds, whether tokens are arriving or not) frees the slots; a sequence's error
        is raised and ends the others."""
        failed = False
        checked = time.monotonic()
        try:
            while not self.done:
                if disconnected is None:
                    index, event = await self.queue.get()
                else:
                    try:
                        index, event = await asyncio.wait_for(self.queue.get(), DISCONNECT_CHECK)
                    except asyncio.TimeoutError:
                        index, event = 0, None
                    if event is None or time.monotonic() - checked >= DISCONNECT_CHECK:
                        checked = time.monotonic()
                        if await disconnected():
                            return
                    if event is None:
                        continue
                if isinstance(event, Exception):
                    failed = True
                    raise event
                self._record(index, event)
                if event.finish_reason is not None:
                    self.finals[index] = event
                    if self.done:
                        self.metrics.requests.labels(self.endpoint, "200").inc()
                yield index, event
        finally:
            if not self.done:
                self._cancel_unfinished()
                if not failed:
                    self.metrics.requests.labels(self.endpoint, "499").inc()

    def _cancel_unfinished(self) -> None:
        # (jobs is shorter than finals while the requests are being submitted)
        for job, final in zip(self.jobs, self.finals, strict=False):
            if final is None:
                self.runner.cancel(job)

    def _record(self, index: int, event: GenResponse) -> None:
        now = time.perf_counter()
        m = self.metrics
        last = self.last_token_at[index]
        if event.token is not None:
            if last is None:
                m.ttft.observe(now - self.arrived)
                m.prompt_tokens.inc(event.stats.prompt_tokens)
            else:
                m.tpot.observe(now - last)
            self.last_token_at[index] = now
            self.counted[index] += 1
            m.generation_tokens.inc()
        if event.finish_reason is not None:
            m.e2e.observe(now - self.arrived)
            m.cached_tokens.inc(event.stats.prompt_tokens - event.stats.prompt_processed)
            if self.last_token_at[index] is None:
                m.prompt_tokens.inc(event.stats.prompt_tokens)
            # An end-of-text token counts in usage but is never streamed.
            m.generation_tokens.inc(max(event.stats.completion_tokens - self.counted[index], 0))


def usage_of(finals: list[GenResponse], choices: int = 1) -> dict[str, Any]:
    """OpenAI's usage of a request's sequences: `choices` per prompt, whose prompt
    counts once."""
    prompts = [final.stats for final in finals[::choices]]
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(final.stats.completion_tokens for final in finals)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # Prompt tokens whose keys and values came from the prefix cache, as OpenAI reports.
        "prompt_tokens_details": {
            "cached_tokens": sum(s.prompt_tokens - s.prompt_processed for s in prompts)
        },
    }
    drafted = sum(final.stats.drafted for final in finals)
    if drafted:
        # Speculative decoding's drafts, as OpenAI reports a predicted output's tokens.
        accepted = sum(final.stats.accepted for final in finals)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return usage


def sse(
    gen: Generation,
    chunks: Callable[[int, GenResponse], list[dict]],
    usage_chunk: dict | None,
    usage: Callable[[], dict],
) -> EventSourceResponse:
    """Stream `chunks(index, event)` of each sequence's events as `data:` lines, then
    usage, then [DONE]."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for index, event in gen.events():
                for chunk in chunks(index, event):
                    yield json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
            if usage_chunk is not None:
                yield json.dumps({**usage_chunk, "usage": usage()}, separators=(",", ":"))
        except Exception as e:
            error = as_api_error(e)
            gen.metrics.requests.labels(gen.endpoint, str(error.status)).inc()
            yield json.dumps(error.body())
        yield "[DONE]"

    # On shutdown, sse_starlette cuts streams unless given a grace period; within it the
    # scheduler's "shutting down" error reaches `lines`, which ends the stream properly.
    return EventSourceResponse(lines(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE)
