"""`llmrun serve`: an OpenAI-compatible HTTP API over the batching scheduler.

Starlette app served by uvicorn: /v1/chat/completions, /v1/completions and
/v1/responses (responses.py), as JSON or server-sent events; llama.cpp's /infill
(infill.py) for code completion; /v1/embeddings (the one
endpoint of an embedding model, which gets no scheduler); /v1/rerank, /rerank and /v1/score
(rerank.py: a reranker's, which gets none either); /v1/audio/transcriptions
(transcriptions.py: an audio model's speech to text) and /v1/audio/translations (a Whisper
model's); /v1/models, /health
(503 until the model is loaded), /metrics (Prometheus text) and llama.cpp's
/lora-adapters (lora.py: the adapters' scales, which a request's `lora` overrides).
ollama's /api/* endpoints live in ollama.py and ollama_models.py.
Requests are validated here (pydantic), errors come back in OpenAI's JSON error shape, and
generation happens on the scheduler thread (batching.py); each request's events
cross into the event loop through its own asyncio queue. Imported only by
`serve`: its libraries are the `serve` extra.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_TYPE
from prometheus_client import (
    generate_latest,
)
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmrun import __version__, api, batching
from llmrun.chat import PLAIN_STOP
from llmrun.errors import UsageError
from llmrun.generate import Response as GenResponse
from llmrun.loading import gemma4_assistant
from llmrun.reasoning import REASONING
from llmrun.server import anthropic, llama_server, ollama, ollama_models
from llmrun.server.audio import audio_refs, media_digests, read_audio
from llmrun.server.images import check_body, image_refs, read_images
from llmrun.server.infill import infill, suffix_prompts
from llmrun.server.lora import lora_adapters, request_lora
from llmrun.server.reply import Ask, ReplyReader, is_reasoning, prepare
from llmrun.server.rerank import rerank, score
from llmrun.server.responses import responses
from llmrun.server.schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    NamedToolChoice,
    as_api_error,
    check_history,
    check_tools,
)
from llmrun.server.serial import choice_options, options_of
from llmrun.server.service import (
    MAX_BODY_BYTES,
    MAX_IMAGE_BODY_BYTES,
    Generation,
    Service,
    begin,
    choices_of,
    read_json,
    sampling_of,
    sse,
    usage_of,
)
from llmrun.server.transcriptions import transcriptions, translations
from llmrun.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN
from llmrun.tool_calls import ToolCall

LOG = logging.getLogger("uvicorn.error")


# --- endpoints ------------------------------------------------------------------------


def _token_logprob(tokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat_ask(engine: api.Engine, body: ChatBody) -> Ask:
    """What a chat completion request asks, checked (tools, history, response format)."""
    check_tools(body.tools, body.tool_choice)
    messages = [m.as_dict() for m in body.messages]
    check_history(messages)
    choice = body.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    schema = None
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        schema = {}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        schema = fmt.json_schema.schema_
    return Ask(
        messages,
        tools=[t.as_dict() for t in body.tools or []],
        tool_choice=choice,
        parallel=body.parallel_tool_calls is not False,
        schema=schema,
        schema_param="response_format.json_schema.schema",
        switches=engine.switches(effort=body.reasoning_effort, kwargs=body.chat_template_kwargs),
    )


def _call_chunks(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: its id and name, then its arguments."""
    head = {"index": index, "id": call.id, "type": "function"}
    return [
        {"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, ChatBody, MAX_IMAGE_BODY_BYTES)
    ask = chat_ask(engine, body)
    refs = image_refs(ask.messages, "messages")
    clips = audio_refs(ask.messages, "messages")
    check_body(request, [*refs, *clips], MAX_BODY_BYTES)
    pictures = await read_images(engine, service.image_encoder, service.model_id, refs)
    if pictures is not None:
        ask.images = pictures.embeds
    sound = await read_audio(engine, service.audio_encoder, service.model_id, clips)
    if sound is not None:
        ask.audio = sound.embeds
    digests = media_digests(ask.messages, pictures, sound)
    params, stop = sampling_of(engine, body)
    lora = request_lora(engine, body)
    if engine.template is None:
        stop.append(PLAIN_STOP)
    # Off the event loop: a long conversation takes a while to render and encode, and a
    # new schema to compile.
    prepared = await asyncio.to_thread(prepare, engine, service.tool_format, ask)
    if prepared.grammar is not None:
        params = params.updated(grammar=prepared.grammar)
    readers = [ReplyReader(engine, prepared) for _ in range(body.n)]
    top = (body.top_logprobs or 0) if body.logprobs else None
    gen_requests = [
        batching.Request(
            prepared.ids,
            choice_params,
            body.max_completion_tokens or body.max_tokens,
            prepared.stops(stop),
            top,
            body.ignore_eos,
            history_end=prepared.history_end,
            lora=lora,
            images=prepared.images,
            image_digests=digests,
            text_to_text=choice_text_to_text,
        )
        for choice_params, choice_text_to_text in zip(
            choices_of(params, body.n),
            choice_options(engine, params, top, None, body.n),
            strict=True,
        )
    ]
    gen = Generation(service, "chat", gen_requests, arrived)
    tokenizer = engine.tokenizer
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": service.model_id,
        "system_fingerprint": f"llmrun-{__version__}",
    }

    def usage() -> dict[str, Any]:
        counts = usage_of(gen.finals, body.n)
        if readers[0].split.markers is not None:
            reasoning = sum(reader.split.tokens[REASONING] for reader in readers)
            counts["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return counts

    def logprobs(event: GenResponse) -> list[dict] | None:
        entries = []
        for lp in event.logprobs:
            entry = _token_logprob(tokenizer, lp.token, lp.logprob)
            entry["top_logprobs"] = [_token_logprob(tokenizer, i, v) for i, v in lp.top]
            entries.append(entry)
        return entries or None

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage_field = {"usage": None} if include_usage else {}
        chunk_head = {**head, "object": "chat.completion.chunk"}
        role_sent = [False] * body.n

        def chunk(
            index: int, delta: dict, lps: list[dict] | None = None, finish: str | None = None
        ) -> dict:
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": {"content": lps} if lps else None,
                "finish_reason": finish,
            }
            return {**chunk_head, "choices": [choice], **usage_field}

        def chunks(index: int, event: GenResponse) -> list[dict]:
            reader, out = readers[index], []
            if not role_sent[index]:
                role_sent[index] = True
                out.append(chunk(index, {"role": "assistant", "content": ""}))
            items, lps = reader.feed(event), logprobs(event)
            for item in items:
                if isinstance(item, ToolCall):
                    deltas = _call_chunks(reader.calls.index(item), item)
                elif is_reasoning(item):
                    deltas = [{"reasoning_content": str(item)}]
                else:
                    deltas = [{"content": str(item)}]
                for delta in deltas:
                    out.append(chunk(index, delta, lps))
                    lps = None
            if lps:
                out.append(chunk(index, {"content": ""}, lps))
            if event.finish_reason is not None:
                finish = reader.finish_reason(event.finish_reason)
                out.append(chunk(index, {}, finish=finish))
            return out

        usage_head = {**chunk_head, "choices": []} if include_usage else None
        return sse(gen, chunks, usage_head, usage)

    tokens: list[list[dict]] = [[] for _ in range(body.n)]
    async for index, event in gen.events(request.is_disconnected):
        readers[index].feed(event)
        tokens[index].extend(logprobs(event) or [])
    if not gen.done:
        return Response(status_code=499)
    choices = []
    for index, (reader, final) in enumerate(zip(readers, gen.finals, strict=True)):
        calls = reader.calls
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reader.content or (None if calls else ""),
        }
        if reader.has_reasoning:
            message["reasoning_content"] = reader.reasoning or None
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": tokens[index]} if body.logprobs else None,
                "finish_reason": reader.finish_reason(final.finish_reason),
            }
        )
    result = {**head, "object": "chat.completion", "choices": choices}
    return JSONResponse({**result, "usage": usage()})


def _prompts(tokenizer, prompt: str | list) -> list[list[int]]:
    """A completion request's prompts as token ids, each checked."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if many else [prompt]
    out = []
    for i, one in enumerate(prompts):
        param = f"prompt.{i}" if many else "prompt"
        if isinstance(one, str):
            ids = tokenizer.encode(one)
        else:
            ids = one
            if not all(0 <= t < tokenizer.vocab_size for t in ids):
                message = f"{param}: token ids must be in [0, {tokenizer.vocab_size})"
                raise ApiError(400, message, param=param)
        if not ids:
            raise ApiError(400, f"{param}: the prompt is empty", param=param)
        out.append(ids)
    return out


def _echo(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """A prompt's text as `echo` puts it first, and where each token's text begins."""
    decoder = tokenizer.stream()
    text, offsets = "", []
    for token in ids:
        offsets.append(len(text))
        text += decoder.add(token)
    return text + decoder.flush(), offsets


async def completions(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, CompletionBody)
    params, stop = sampling_of(engine, body)
    lora = request_lora(engine, body)
    options = options_of(engine, body)
    tokenizer = engine.tokenizer
    if body.suffix and body.echo:
        raise ApiError(400, "echo does not go with a suffix", param="echo")
    if body.suffix:
        prompts = await asyncio.to_thread(
            suffix_prompts, engine, service.model_id, body.prompt, body.suffix, body.max_tokens
        )
    else:
        prompts = await asyncio.to_thread(_prompts, tokenizer, body.prompt)
    n = body.n
    echoes = [_echo(tokenizer, ids) for ids in prompts] if body.echo else []
    choices = list(
        zip(
            choices_of(params, n),
            choice_options(engine, params, body.logprobs, options, n),
            strict=True,
        )
    )
    # Choice index = prompt index x n + choice of that prompt, as OpenAI numbers them.
    gen_requests = [
        batching.Request(
            prompt,
            choice_params,
            body.max_tokens,
            stop,
            body.logprobs,
            body.ignore_eos,
            prompt_logprobs=body.logprobs if body.echo else None,
            lora=lora,
            text_to_text=choice_text_to_text,
        )
        for prompt in prompts
        for choice_params, choice_text_to_text in choices
    ]
    gen = Generation(service, "completions", gen_requests, arrived)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.model_id,
        "system_fingerprint": f"llmrun-{__version__}",
    }
    echoed = [not body.echo] * len(gen_requests)

    def text(index: int, event: GenResponse) -> str:
        """The event's text, after the prompt's where the choice is to echo it first."""
        if echoed[index]:
            return event.text
        echoed[index] = True
        return echoes[index // n][0] + event.text

    def logprobs(index: int, event: GenResponse) -> dict[str, list] | None:
        piece = tokenizer.token_to_piece
        if event.prompt_logprobs:  # echo's: the prompt tokens, the first one unscored
            ids, (_, offsets) = prompts[index // n], echoes[index // n]
            scored = event.prompt_logprobs
            return {
                "tokens": [piece(token) for token in ids],
                "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
                "top_logprobs": [
                    None if lp is None else {piece(i): v for i, v in lp.top} for lp in scored
                ],
                "text_offset": offsets,
            }
        if not event.logprobs:
            return None
        shift = len(echoes[index // n][0]) if body.echo else 0
        return {
            "tokens": [piece(lp.token) for lp in event.logprobs],
            "token_logprobs": [lp.logprob for lp in event.logprobs],
            "top_logprobs": [{piece(i): v for i, v in lp.top} for lp in event.logprobs],
            "text_offset": [lp.offset + shift for lp in event.logprobs],
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage_field = {"usage": None} if include_usage else {}

        def chunks(index: int, event: GenResponse) -> list[dict]:
            lps, piece = logprobs(index, event), text(index, event)
            if not (piece or lps or event.finish_reason):
                return []
            choice = {
                "index": index,
                "text": piece,
                "logprobs": lps,
                "finish_reason": event.finish_reason,
            }
            return [{**head, "choices": [choice], **usage_field}]

        usage_head = {**head, "choices": []} if include_usage else None
        return sse(gen, chunks, usage_head, lambda: usage_of(gen.finals, n))

    pieces: list[list[str]] = [[] for _ in gen_requests]
    merged = [
        {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        for _ in gen_requests
    ]
    async for index, event in gen.events(request.is_disconnected):
        pieces[index].append(text(index, event))
        for key, values in (logprobs(index, event) or {}).items():
            merged[index][key].extend(values)
    if not gen.done:
        return Response(status_code=499)
    choices = [
        {
            "index": index,
            "text": "".join(pieces[index]),
            "logprobs": merged[index] if body.logprobs is not None else None,
            "finish_reason": final.finish_reason,
        }
        for index, final in enumerate(gen.finals)
    ]
    return JSONResponse({**head, "choices": choices, "usage": usage_of(gen.finals, n)})


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings: a vector per input, pooled as the model (or serve's --pooling)
    says, in OpenAI's list shape."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, EmbeddingBody)
    engine = service.ready_engine(body.model)
    if engine.reranks:
        raise ApiError(
            400,
            f"{service.model_id} is a reranker; use /v1/rerank",
            param="model",
            code="model_not_supported",
        )
    many = isinstance(body.input, list) and not isinstance(body.input[0], int)
    inputs = body.input if many else [body.input]
    pooling = service.pooling or engine.checkpoint.pooling
    if pooling is None:
        raise ApiError(
            400,
            f"{service.model_id} names no pooling (it is not an embedding model): start serve "
            "with --pooling mean, cls or last",
            param="model",
        )

    def embed():
        with service.embed_lock:
            return engine.embed(inputs, pooling, body.embd_normalize == 2, truncate=body.truncate)

    result = await asyncio.to_thread(embed)
    width = result.vectors.shape[1]
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(
            400,
            f"dimensions {body.dimensions}: this model's vectors have {width} (llmrun does "
            "not shorten them)",
            param="dimensions",
        )
    vectors = result.vectors
    if body.encoding_format == "base64":
        raw = vectors.numpy().astype("<f4")
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in raw]
    else:
        data = vectors.tolist()
    service.metrics.requests.labels("embeddings", "200").inc()
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": vector}
                for i, vector in enumerate(data)
            ],
            "model": service.model_id,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
    )


async def models(request: Request) -> Response:
    """GET /v1/models: the one model served; /v1/models/{id}: its card, by any of its
    names."""
    service: Service = request.app.state.service
    service.authorize(request)
    card = {
        "id": service.model_id,
        "object": "model",
        "created": service.created,
        "owned_by": "llmrun",
    }
    wanted = request.path_params.get("model")
    if wanted is None:
        return JSONResponse({"object": "list", "data": [card]})
    if wanted not in service.names:
        raise ApiError(
            404,
            f"the model {wanted!r} does not exist; this server serves {service.model_id!r}",
            param="model",
            code="model_not_found",
        )
    return JSONResponse(card)


async def health(request: Request) -> Response:
    service: Service = request.app.state.service
    scheduler = service.scheduler
    if service.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if scheduler is None:  # an embedding model: no slots, no KV blocks
        return JSONResponse({"status": "ok"})
    blocks = scheduler.blocks
    kv_blocks = {
        "block_size": blocks.block_size,
        "total": blocks.n_blocks,
        "used": blocks.used,
        "cached": blocks.cached_blocks,
    }
    if blocks.window_manager is not None:  # the sliding-window layers' pool
        window = blocks.window_manager
        kv_blocks["window"] = {
            "positions": blocks.window,
            "total": window.n_blocks,
            "used": window.used,
            "cached": window.cached_blocks,
        }
    return JSONResponse(
        {
            "status": "ok",
            "slots": scheduler.parallel,
            "running": len(scheduler.active),
            "waiting": len(scheduler.waiting),
            "kv_blocks": kv_blocks,
        }
    )


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(generate_latest(service.metrics.registry), media_type=PROMETHEUS_TYPE)


# Where each endpoint's prompt comes from (a prompt too long for the context is about it).
PROMPT_PARAMS = {
    "completions": "prompt",
    "responses": "input",
    "embeddings": "input",
    "infill": "input_prefix",
    "completion": "prompt",
    "rerank": "documents",
    "score": "text_2",
    "transcriptions": "file",
    "translations": "file",
}


def _endpoint(handler: Callable, name: str | None = None) -> Callable:
    """`handler` with every failure answered as an OpenAI error (and counted under `name`)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            error = as_api_error(e, PROMPT_PARAMS.get(name, "messages"))
            if name is not None:
                request.app.state.service.metrics.requests.labels(name, str(error.status)).inc()
            return error.response()

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, exc.detail, headers=exc.headers).response()


def create_app(service: Service) -> Starlette:

    routes = [
        Route("/v1/chat/completions", _endpoint(chat_completions, "chat"), methods=["POST"]),
        Route("/v1/responses", _endpoint(responses, "responses"), methods=["POST"]),
        Route("/v1/completions", _endpoint(completions, "completions"), methods=["POST"]),
        Route("/v1/embeddings", _endpoint(embeddings, "embeddings"), methods=["POST"]),
        Route("/infill", _endpoint(infill, "infill"), methods=["POST"]),
        Route("/v1/rerank", _endpoint(rerank, "rerank"), methods=["POST"]),
        Route("/rerank", _endpoint(rerank, "rerank"), methods=["POST"]),
        Route("/v1/score", _endpoint(score, "score"), methods=["POST"]),
        Route(
            "/v1/audio/transcriptions",
            _endpoint(transcriptions, "transcriptions"),
            methods=["POST"],
        ),
        Route("/v1/audio/translations", _endpoint(translations, "translations"), methods=["POST"]),
        Route("/v1/models", _endpoint(models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(models), methods=["GET"]),
        Route("/lora-adapters", _endpoint(lora_adapters), methods=["GET", "POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        # Anthropic's Messages API (anthropic.py)
        Route("/v1/messages", anthropic.endpoint(anthropic.messages, "messages"), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens",
            anthropic.endpoint(anthropic.count_tokens, "count_tokens"),
            methods=["POST"],
        ),
        # llama-server's own endpoints (llama_server.py)
        Route("/completion", _endpoint(llama_server.completion, "completion"), methods=["POST"]),
        Route("/completions", _endpoint(llama_server.completion, "completion"), methods=["POST"]),
        Route("/tokenize", _endpoint(llama_server.tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(llama_server.detokenize), methods=["POST"]),
        Route("/apply-template", _endpoint(llama_server.apply_template), methods=["POST"]),
        Route("/props", _endpoint(llama_server.props), methods=["GET"]),
        # ollama's API (ollama.py, ollama_models.py)
        Route("/api/chat", ollama.endpoint(ollama.chat), methods=["POST"]),
        Route("/api/generate", ollama.endpoint(ollama.generate), methods=["POST"]),
        Route("/api/embed", ollama.endpoint(ollama.embed), methods=["POST"]),
        Route("/api/embeddings", ollama.endpoint(ollama.embeddings), methods=["POST"]),
        Route("/api/tags", ollama.endpoint(ollama_models.tags), methods=["GET"]),
        Route("/api/show", ollama.endpoint(ollama_models.show), methods=["POST"]),
        Route("/api/ps", ollama.endpoint(ollama_models.ps), methods=["GET"]),
        Route("/api/version", ollama_models.version, methods=["GET"]),
        Route("/", ollama_models.heartbeat, methods=["GET", "HEAD"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.service = service
    return app


# --- running it -----------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server that, told to exit (Ctrl-C, SIGTERM), first ends the requests in
    flight: each gets "the server is shutting down" (a 503, or an error event and
    [DONE] on a stream) while uvicorn drains the connections."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            # Off the signal handler: closing waits for the scheduler's current step.
            threading.Thread(target=self.service.close, name="llmrun-close").start()
        super().handle_exit(sig, frame)


def _towers(path: Path, mmproj: str | Path | None) -> tuple[bool, bool]:
    """Which encoders serve loads, (images, audio): a Hugging Face folder's own towers
    (llmrun.vision_families, llmrun.audio_families), or those of a GGUF's `mmproj`: both
    where it holds both (Gemma 4's, Qwen2.5-Omni's); one of neither kind goes to the image
    loader, whose error names its projector."""
    from llmrun import audio_families, vision_families

    if mmproj is None:
        folder = vision_families.of_folder(path), audio_families.of_folder(path)
        return folder[0] is not None, folder[1] is not None
    audio = audio_families.of_mmproj(Path(mmproj)) is not None
    return vision_families.of_mmproj(Path(mmproj)) is not None or not audio, audio


def _use_speculation(
    engine: api.Engine,
    draft: tuple[str, Path] | None,
    draft_max: int,
    draft_p_min: float,
    lookup: int | None,
    load_options: dict[str, Any],
) -> None:
    """Give `engine` serve's speculator: the draft model loaded as the model was (its
    device, context, dtype, threads, cache type and activations), or prompt lookup."""
    if (draft is not None or lookup is not None) and not engine.generates:
        raise UsageError(
            f"--draft and --lookup need a model that generates; {engine.name} does not"
        )
    if (draft is not None or lookup is not None) and engine.text_to_text:
        raise UsageError(
            f"--draft and --lookup do not go with {engine.name} (a text-to-text model)"
        )
    if lookup is not None:
        engine.use_lookup(lookup)
    if draft is None:
        return
    shared = ("dtype", "threads", "cache_type", "activations")
    options = {k: v for k, v in load_options.items() if k in shared}
    spec, path = draft
    if gemma4_assistant.is_assistant(path):
        raise UsageError(
            f"--draft {spec}: serve does not draft with a Gemma 4 assistant (run, chat and "
            "bench do)"
        )
    small = api.load(
        spec, path=path, device=engine.device.type, ctx_size=engine.ctx_size, **options
    )
    engine.use_draft(small, draft_max, draft_p_min)
    LOG.info(
        "speculative decoding with the draft %s, up to %d tokens a step", small.name, draft_max
    )


def run(
    sock: socket.socket,
    spec: str | None,
    path: Path,
    model_id: str,
    api_key: str | None = None,
    parallel: int = 4,
    queue: int = 64,
    kv_memory: int | None = None,
    prefix_cache: bool = True,
    pooling: str | None = None,
    draft: tuple[str, Path] | None = None,
    draft_max: int = DEFAULT_DRAFT_MAX,
    draft_p_min: float = DEFAULT_DRAFT_P_MIN,
    lookup: int | None = None,
    **load_options: Any,
) -> None:
    """Serve on `sock` until interrupted; the model loads in the background while
    /health answers 503. A failed load stops the server and is raised. `draft` (the
    name and path of a draft model) or `lookup`: speculative decoding while one request
    runs (llmrun.batching). `load_options` go to api.load; a folder's vision or audio tower
    loads too, as a GGUF's `mmproj` does (requests' images and audio:
    llmrun.server.images, llmrun.server.audio)."""
    if load_options.get("threads") is None:
        # Leave a core to the HTTP side (event loop, JSON, SSE): torch's threads wait
        # for each other at every op, so one preempted thread stalls them all.
        load_options["threads"] = max(1, (os.cpu_count() or 1) - 1)
    aliases = {str(spec)} if spec else set()
    aliases |= {path.name, path.stem}
    service = Service(model_id, aliases, api_key, parallel, queue, kv_memory, prefix_cache, pooling)
    server = _Server(
        uvicorn.Config(
            create_app(service), log_level="info", timeout_graceful_shutdown=5, lifespan="off"
        ),
        service,
    )

    def load() -> None:
        try:
            vision, audio = _towers(path, load_options.get("mmproj"))
            engine = api.load(
                spec, path=path, generate=False, vision=vision, audio=audio, **load_options
            )
            _use_speculation(engine, draft, draft_max, draft_p_min, lookup, load_options)
            service.start(engine)
            if service.scheduler is None:
                LOG.info(
                    "model %s loaded in %.1fs: %s",
                    model_id,
                    engine.load_seconds,
                    "a reranker (/v1/rerank, /v1/score)"
                    if engine.reranks
                    else "speech recognition (/v1/audio/transcriptions, /v1/audio/translations)"
                    if engine.transcribes
                    else "text-to-text (/v1/completions"
                    + (", /v1/chat/completions" if engine.template is not None else "")
                    + ", one request at a time)"
                    if engine.text_to_text
                    else "an embedding model (/v1/embeddings)",
                )
                return
            blocks = service.scheduler.blocks
            windows = ""
            if blocks.window_manager is not None:
                windows = (
                    f" (and {blocks.window_manager.n_blocks} for the layers with a sliding "
                    f"window of {blocks.window})"
                )
            LOG.info(
                "model %s loaded in %.1fs; up to %d sequences of %d tokens over %d KV "
                "blocks of %d tokens%s, %.1f MiB%s",
                model_id,
                engine.load_seconds,
                parallel,
                engine.ctx_size,
                blocks.n_blocks,
                blocks.block_size,
                windows,
                service.scheduler.cache.nbytes / 2**20,
                ("" if prefix_cache else ", no prefix cache")
                + (", takes images" if engine.vision is not None else "")
                + (", takes audio" if engine.audio is not None else ""),
            )
        except BaseException as e:
            service.load_error = e
            server.should_exit = True

    threading.Thread(target=load, name="llmrun-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        service.close()
    if service.load_error is not None:
        raise service.load_error
