"""ollama's API over serve's service: /api/chat, /api/generate, /api/embed, /api/embeddings.

The same scheduler, prompts (reply.prepare), grammars and reply reader as /v1, in ollama's
shapes: replies stream as NDJSON unless `"stream": false`, each line `{model, created_at,
message | response, done}`, the last one with `done_reason` and the counts and durations
(nanoseconds); `options` map to the sampler (unknown ones are ignored, as ollama does;
`num_ctx` too: the context is serve's --ctx-size, fixed when the model loads); `think`
sets the template's thinking switch (true/false) or reasoning effort ("low", "medium",
"high"), and the reasoning comes back in `thinking`; `format` is "json" or a JSON schema;
tool calls carry their arguments as objects; base64 `images` become the image parts
/v1 takes (server.images). Errors are `{"error": "..."}` with a 4xx status, or an error
line in a stream. The model's card (/api/tags, /api/show, /api/ps,
/api/version) is ollama_models.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmrun import api, batching
from llmrun.chat import PLAIN_STOP
from llmrun.generate import Response as GenResponse
from llmrun.reasoning import EFFORT_VARIABLES
from llmrun.server.images import Encoded, check_body, image_refs, read_images
from llmrun.server.infill import suffix_prompts
from llmrun.server.reply import Ask, Prepared, ReplyReader, is_reasoning, prepare
from llmrun.server.schema import (
    ApiError,
    Body,
    Probability,
    Seed,
    StopText,
    TextToTextFields,
    Tool,
    as_api_error,
    check_tools,
)
from llmrun.server.serial import options_of
from llmrun.server.service import (
    MAX_BODY_BYTES,
    MAX_IMAGE_BODY_BYTES,
    Generation,
    Service,
    read_json,
)
from llmrun.tool_calls import ToolCall

NDJSON = "application/x-ndjson"
LATEST = ":latest"  # ollama's default tag: "name" and "name:latest" are one model


# --- request bodies ---------------------------------------------------------------------


class Options(TextToTextFields):
    """The `options` llmrun's sampler takes, and a text-to-text model's beams and languages
    (llmrun's extensions); the rest of ollama's are accepted and ignored."""

    temperature: Annotated[float, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Probability | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    num_predict: int | None = None  # -1: no limit, -2: until the context is full
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    seed: Seed | None = None  # negative: a random seed, as ollama's -1
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None

    @field_validator("num_predict")
    @classmethod
    def _a_count_or_no_limit(cls, value: int) -> int:
        if value == 0 or value < -2:
            raise ValueError("must be a positive count, -1 (no limit) or -2 (fill the context)")
        return value


class Generating(Body):
    model: str | None = None
    stream: bool = True
    options: Options | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: Any = None  # the model stays loaded for the server's life


class CallFunction(BaseModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class CallIn(BaseModel):
    id: str | None = None
    function: CallFunction


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[CallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ChatBody(Generating):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateBody(Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedBody(Body):
    model: str | None = None
    input: str | list[str]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None


class EmbeddingsBody(Body):
    model: str | None = None
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Any = None


# --- what every endpoint shares ---------------------------------------------------------


def now() -> str:
    """A timestamp as ollama writes them (RFC 3339, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def served_name(service: Service, name: str | None) -> str | None:
    """`name` as serve knows it: ollama's "NAME:latest" is NAME."""
    if name is not None and name not in service.names and name.endswith(LATEST):
        bare = name.removesuffix(LATEST)
        if bare in service.names:
            return bare
    return name


def listed_name(service: Service) -> str:
    """The served model's name as ollama lists it, with a tag."""
    return service.model_id if ":" in service.model_id else service.model_id + LATEST


def model_engine(service: Service, name: str | None) -> api.Engine:
    return service.ready_engine(served_name(service, name))


# Where each endpoint's prompt comes from (a prompt too long for the context is about it).
PROMPT_PARAMS = {"chat": "messages", "generate": "prompt", "embed": "input", "embeddings": "prompt"}


def endpoint(handler: Callable) -> Callable:
    """`handler` with every failure answered as ollama does: {"error": message} with its
    status (counted as endpoint ollama_NAME)."""
    name = handler.__name__

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            error = as_api_error(e, PROMPT_PARAMS.get(name, "model"))
            metric = request.app.state.service.metrics.requests
            metric.labels(f"ollama_{name}", str(error.status)).inc()
            return JSONResponse(
                {"error": error.message}, status_code=error.status, headers=error.headers
            )

    return wrapped


async def _begin(request: Request, schema: type[Generating]) -> tuple[Service, Any, api.Engine]:
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, schema, MAX_IMAGE_BODY_BYTES)
    engine = model_engine(service, body.model)
    if not engine.generates:
        use = (
            "a reranker"
            if engine.reranks
            else f"a speech recognition model ({engine.speech_family}); use "
            "/v1/audio/transcriptions"
            if engine.transcribes
            else "an embedding model; use /api/embed"
        )
        raise ApiError(400, f"{service.model_id} is {use}", param="model")
    return service, body, engine


def with_images(content: str, images: list[str] | None, where: str) -> str | list[dict]:
    """A message's content with its base64 `images` before the text, as image parts
    (llmrun.server.images reads them)."""
    if not images:
        return content
    parts: list[dict[str, Any]] = [
        {
            "type": "image",
            "url": image if image.startswith("data:") else "data:;base64," + image,
            "param": f"{where}.{k}",
        }
        for k, image in enumerate(images)
    ]
    return [*parts, {"type": "text", "text": content}]


async def pictures_of(
    request: Request, service: Service, engine: api.Engine, messages: list[dict], where: str
) -> Encoded | None:
    """The messages' images, checked and encoded (None without any)."""
    refs = image_refs(messages, where)
    check_body(request, refs, MAX_BODY_BYTES)
    return await read_images(engine, service.image_encoder, service.model_id, refs)


def sampling(engine: api.Engine, options: Options | None) -> tuple[Any, list[str], int | None]:
    """The sampler's parameters, the stop strings and the token limit that `options` ask."""
    o = options or Options()
    params = engine.defaults.updated(
        temperature=o.temperature,
        top_k=o.top_k,
        top_p=o.top_p,
        min_p=o.min_p,
        repeat_penalty=o.repeat_penalty,
        repeat_last_n=o.repeat_last_n,
        presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty,
        seed=o.seed if o.seed is not None and o.seed >= 0 else None,
    )
    stop = [o.stop] if isinstance(o.stop, str) else list(o.stop or [])
    limit = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    return params, stop, limit


def switches(engine: api.Engine, think: bool | str | None) -> dict[str, Any]:
    """The template variables `think` sets: the thinking switch, or the reasoning effort."""
    if think is None:
        return {}
    variables = engine.template.variables if engine.template is not None else set()
    if isinstance(think, str):
        effort = next((v for v in EFFORT_VARIABLES if v in variables), None)
        if effort is None:
            raise ApiError(
                400,
                f"think {think!r}: this model's chat template takes no reasoning effort "
                "(send true or false)",
                param="think",
            )
        return {effort: think}
    switch = next((v for v in ("enable_thinking", "thinking") if v in variables), None)
    if switch is not None:
        return {switch: think}
    if think and engine.markers is None:
        raise ApiError(400, f"{engine.name} does not support thinking", param="think")
    return {}  # a model that always thinks, or never does


def schema_of(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`format` as Ask.schema: {} for any JSON object, else the JSON schema."""
    if fmt == "json":
        return {}
    return fmt if isinstance(fmt, dict) else None


def _call(index: int, call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = {}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


class Reply:
    """One request's reply as ollama reports it: the pieces of each event (content,
    thinking, tool calls), then the whole and the final counts and durations."""

    def __init__(self, reader: ReplyReader | None, arrived: float) -> None:
        self.reader = reader  # None: raw text, read as generated
        self.arrived = arrived
        self.first_at: float | None = None
        self.text = ""
        self.tokens: list[int] = []

    def feed(self, event: GenResponse) -> list[dict[str, Any]]:
        if event.token is not None:
            self.tokens.append(event.token)
            if self.first_at is None:
                self.first_at = time.perf_counter()
        if self.reader is None:
            self.text += event.text
            return [{"content": event.text}] if event.text else []
        out = []
        for item in self.reader.feed(event):
            if isinstance(item, ToolCall):
                out.append({"tool_calls": [_call(self.reader.calls.index(item), item)]})
            elif str(item):
                out.append({"thinking" if is_reasoning(item) else "content": str(item)})
        return out

    def whole(self) -> dict[str, Any]:
        """The reply's content, thinking and calls, as one message."""
        if self.reader is None:
            return {"content": self.text}
        message: dict[str, Any] = {"content": self.reader.content}
        if self.reader.reasoning:
            message["thinking"] = self.reader.reasoning
        if self.reader.calls:
            message["tool_calls"] = [_call(i, c) for i, c in enumerate(self.reader.calls)]
        return message

    def final(self, event: GenResponse) -> dict[str, Any]:
        done = time.perf_counter()
        first = self.first_at or done
        ns = 1_000_000_000
        return {
            "done": True,
            "done_reason": event.finish_reason,
            "total_duration": round((done - self.arrived) * ns),
            "load_duration": 0,  # the model was loaded before the request came
            "prompt_eval_count": event.stats.prompt_tokens,
            "prompt_eval_duration": round((first - self.arrived) * ns),
            "eval_count": event.stats.completion_tokens,
            "eval_duration": round((done - first) * ns),
        }


def _line(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _answer(
    request: Request,
    gen: Generation,
    reply: Reply,
    shape: Callable[[dict[str, Any]], dict[str, Any]],
    extra: Callable[[], dict[str, Any]],
    body: Generating,
) -> Response:
    """The reply streamed as NDJSON lines, or whole: `shape` makes a line's body of a piece
    (or of the whole), `extra` adds what the last line carries besides the counts."""
    head = {"model": body.model or listed_name(gen.service)}

    if body.stream:

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for _, event in gen.events():
                    for piece in reply.feed(event):
                        yield _line({**head, "created_at": now(), **shape(piece), "done": False})
                    if event.finish_reason is not None:
                        last = {**head, "created_at": now(), **shape({"content": ""})}
                        yield _line({**last, **reply.final(event), **extra()})
            except Exception as e:
                error = as_api_error(e)
                gen.metrics.requests.labels(gen.endpoint, str(error.status)).inc()
                yield _line({"error": error.message})

        return StreamingResponse(lines(), media_type=NDJSON)
    async for _, event in gen.events(request.is_disconnected):
        reply.feed(event)
    if not gen.done:
        return Response(status_code=499)
    result = {**head, "created_at": now(), **shape(reply.whole())}
    return JSONResponse({**result, **reply.final(gen.finals[0]), **extra()})


def _loaded(service: Service, name: str | None, shape: dict[str, Any]) -> Response:
    """ollama's answer to a request with nothing to say: the model is loaded."""
    head = {"model": name or listed_name(service), "created_at": now()}
    return JSONResponse({**head, **shape, "done": True, "done_reason": "load"})


# --- /api/chat ------------------------------------------------------------------------


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """ollama's messages as the chat messages reply.prepare takes: call arguments as JSON
    text, each tool message tied to the call it answers (by tool_call_id, else by
    tool_name, else the first call still unanswered)."""
    out: list[dict[str, Any]] = []
    calls: dict[str, dict[str, Any]] = {}
    unanswered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = with_images(m.content or "", m.images, f"messages.{i}.images")
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.thinking and m.role == "assistant":
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            message["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                args = call.function.arguments
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                made = {
                    "id": call.id or f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": text},
                }
                message["tool_calls"].append(made)
                calls[made["id"]] = made
            unanswered = list(message["tool_calls"])
        if m.role == "tool":
            answered = _answered(m, calls, unanswered)
            if answered is None:
                raise ApiError(
                    400,
                    f"messages.{i}: the tool message answers no call of an earlier assistant "
                    "message (its tool_name or tool_call_id names none)",
                    param=f"messages.{i}",
                )
            message["tool_call_id"] = answered["id"]
            message["name"] = answered["function"]["name"]
        out.append(message)
    return out


def _answered(
    message: ChatMessage, calls: dict[str, dict[str, Any]], unanswered: list[dict[str, Any]]
) -> dict[str, Any] | None:
    if message.tool_call_id is not None:
        call = calls.get(message.tool_call_id)
    else:
        name = message.tool_name
        call = next((c for c in unanswered if name in (None, c["function"]["name"])), None)
    if call in unanswered:
        unanswered.remove(call)
    return call


async def chat(request: Request) -> Response:
    """POST /api/chat."""
    arrived = time.perf_counter()
    service, body, engine = await _begin(request, ChatBody)
    if not body.messages:
        return _loaded(service, body.model, {"message": {"role": "assistant", "content": ""}})
    tools = body.tools or []
    check_tools(tools, None)
    messages = conversation(body.messages)
    pictures = await pictures_of(request, service, engine, messages, "messages")
    ask = Ask(
        messages,
        tools=[t.as_dict() for t in tools],
        schema=schema_of(body.format),
        schema_param="format",
        switches=switches(engine, body.think),
        images=pictures.embeds if pictures is not None else [],
    )
    params, stop, limit = sampling(engine, body.options)
    options_of(engine, body.options)  # refused for a model that is not text-to-text
    if engine.template is None:
        stop.append(PLAIN_STOP)
    prepared = await asyncio.to_thread(prepare, engine, service.tool_format, ask)
    if prepared.grammar is not None:
        params = params.updated(grammar=prepared.grammar)
    gen_request = batching.Request(
        prepared.ids,
        params,
        limit,
        prepared.stops(stop),
        history_end=prepared.history_end,
        images=prepared.images,
        image_digests=pictures.digests if pictures is not None else (),
    )
    gen = Generation(service, "ollama_chat", [gen_request], arrived)
    reply = Reply(ReplyReader(engine, prepared), arrived)

    def shape(piece: dict[str, Any]) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": "", **piece}}

    return await _answer(request, gen, reply, shape, dict, body)


# --- /api/generate --------------------------------------------------------------------

# ollama's templates are Go templates; this one says "the prompt as it is".
PLAIN_TEMPLATES = ("{{ .Prompt }}", "{{.Prompt}}")


def _templated(engine: api.Engine, body: GenerateBody) -> bool:
    """Whether the prompt goes through the model's chat template (not raw, a FIM
    suffix, nor a model without one, whose prompt ollama passes as it is)."""
    template = (body.template or "").strip()
    if template and template not in PLAIN_TEMPLATES:
        raise ApiError(
            400,
            "llmrun renders the model's own chat template and takes no custom template: "
            'send "raw": true with the prompt already formatted',
            param="template",
        )
    if body.raw or body.suffix or template or engine.template is None:
        if body.system:
            raise ApiError(
                400,
                "a raw prompt (raw, a suffix, a plain template or a model without a chat "
                "template) has no place for a system message: put it in the prompt",
                param="system",
            )
        return False
    return True


def _raw_prompt(
    engine: api.Engine, service: Service, body: GenerateBody, limit: int | None
) -> list[int]:
    """The ids of a prompt taken as it is (or the FIM prompt around a suffix)."""
    if body.suffix:
        return suffix_prompts(engine, service.model_id, body.prompt, body.suffix, limit)[0]
    return engine.tokenizer.encode(body.prompt)


def _with_context(engine: api.Engine, context: list[int] | None, ids: list[int]) -> list[int]:
    """An earlier reply's `context` (its prompt and reply ids), then this prompt (without
    a second BOS)."""
    if not context:
        return ids
    vocab = engine.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in context):
        raise ApiError(400, f"context: token ids must be in [0, {vocab})", param="context")
    bos = engine.tokenizer.bos_id
    return context + (ids[1:] if bos is not None and ids[:1] == [bos] else ids)


async def generate(request: Request) -> Response:
    """POST /api/generate."""
    arrived = time.perf_counter()
    service, body, engine = await _begin(request, GenerateBody)
    if not body.prompt and not body.suffix:
        return _loaded(service, body.model, {"response": ""})
    params, stop, limit = sampling(engine, body.options)
    schema = schema_of(body.format)
    reader, pictures = None, None
    if _templated(engine, body):
        user = {"role": "user", "content": with_images(body.prompt, body.images, "images")}
        system = [{"role": "system", "content": body.system}] if body.system else []
        pictures = await pictures_of(request, service, engine, [*system, user], "images")
        if pictures is not None and body.context:
            raise ApiError(400, "a context does not go with images", param="context")
        ask = Ask(
            [*system, user],
            schema=schema,
            schema_param="format",
            switches=switches(engine, body.think),
            images=pictures.embeds if pictures is not None else [],
        )
        prepared = await asyncio.to_thread(prepare, engine, None, ask)
        reader = ReplyReader(engine, prepared)
    else:
        for field, value in (("think", body.think), ("images", body.images)):
            if value:
                raise ApiError(
                    400, f"{field} goes with the chat template, not a raw prompt", param=field
                )
        ids = await asyncio.to_thread(_raw_prompt, engine, service, body, limit)
        prepared = Prepared(body.prompt, ids, None, _raw_grammar(engine, schema))
    ids = _with_context(engine, body.context, prepared.ids)
    if prepared.grammar is not None:
        params = params.updated(grammar=prepared.grammar)
    gen_request = batching.Request(
        ids,
        params,
        limit,
        stop,
        history_end=prepared.history_end if not body.context else None,
        images=prepared.images,
        image_digests=pictures.digests if pictures is not None else (),
        text_to_text=options_of(engine, body.options),
    )
    gen = Generation(service, "ollama_generate", [gen_request], arrived)
    reply = Reply(reader, arrived)

    def shape(piece: dict[str, Any]) -> dict[str, Any]:
        out = {"response": piece.get("content", "")}
        if "thinking" in piece:
            out["thinking"] = piece["thinking"]
        return out

    def context() -> dict[str, Any]:
        # As ollama: the conversation so far, to send back; none for a raw prompt.
        return {} if body.raw else {"context": ids + reply.tokens}

    return await _answer(request, gen, reply, shape, context, body)


def _raw_grammar(engine: api.Engine, schema: dict[str, Any] | None) -> Any:
    if schema is None:
        return None
    from llmrun import structured

    vocab = structured.vocabulary(engine.tokenizer, engine.eos_ids)
    try:
        return vocab.json_schema(schema or None, "format")
    except structured.GrammarError as e:
        raise ApiError(400, str(e), param="format") from None


# --- /api/embed, /api/embeddings ------------------------------------------------------


async def _embed(request: Request, schema: type[Body]) -> tuple[Service, Any, api.Engine, str]:
    """The checks both embedding endpoints pass: key, body, a model that pools."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, schema)
    engine = model_engine(service, body.model)
    if engine.reranks:
        raise ApiError(400, f"{service.model_id} is a reranker", param="model")
    pooling = service.pooling or engine.checkpoint.pooling
    if pooling is None:
        raise ApiError(
            400,
            f"{service.model_id} names no pooling (it is not an embedding model): start serve "
            "with --pooling mean, cls or last",
            param="model",
        )
    return service, body, engine, pooling


async def embed(request: Request) -> Response:
    """POST /api/embed: unit-length vectors, cut to `dimensions` (and made unit length
    again) where asked, as ollama's."""
    arrived = time.perf_counter()
    service, body, engine, pooling = await _embed(request, EmbedBody)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    head = {"model": body.model or listed_name(service)}
    if not inputs or inputs == [""]:
        return JSONResponse({**head, "embeddings": []})

    def run():
        with service.embed_lock:
            return engine.embed(inputs, pooling, True, truncate=body.truncate)

    result = await asyncio.to_thread(run)
    vectors = result.vectors
    width = vectors.shape[1]
    if body.dimensions is not None:
        if body.dimensions > width:
            raise ApiError(
                400,
                f"dimensions {body.dimensions}: this model's vectors have {width}",
                param="dimensions",
            )
        vectors = vectors[:, : body.dimensions]
        vectors = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(1e-12)
    service.metrics.requests.labels("ollama_embed", "200").inc()
    return JSONResponse(
        {
            **head,
            "embeddings": vectors.tolist(),
            "total_duration": round((time.perf_counter() - arrived) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens,
        }
    )


async def embeddings(request: Request) -> Response:
    """POST /api/embeddings (ollama's older endpoint): one vector, as the model pools it,
    not made unit length."""
    service, body, engine, pooling = await _embed(request, EmbeddingsBody)
    if not body.prompt:
        return JSONResponse({"embedding": []})

    def run():
        with service.embed_lock:
            return engine.embed([body.prompt], pooling, False)

    result = await asyncio.to_thread(run)
    service.metrics.requests.labels("ollama_embeddings", "200").inc()
    return JSONResponse({"embedding": result.vectors[0].tolist()})
