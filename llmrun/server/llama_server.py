"""llama-server's own endpoints, for the UIs and scripts that call them, with the fields and
shapes llama.cpp's tools/server README gives: POST /completion (and /completions), a prompt
in and llama.cpp's reply out (server-sent `data:` chunks with `stream`, the last one
`stop: true` with the counts and timings, and no [DONE]); POST /tokenize, /detokenize and
/apply-template; GET /props. `complete` answers /infill (infill.py) in the same shape."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import Field
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import __version__, api, batching
from llmrun.generate import Response as GenResponse
from llmrun.sampling import SamplingParams
from llmrun.server.lora import request_lora
from llmrun.server.reply import Ask, prepare
from llmrun.server.schema import (
    ApiError,
    Body,
    ChatBody,
    NamedToolChoice,
    Sampling,
    TextToTextFields,
    as_api_error,
    check_history,
    check_tools,
)
from llmrun.server.serial import options_of
from llmrun.server.service import (
    SHUTDOWN_GRACE,
    Generation,
    Service,
    begin,
    read_json,
    sampling_of,
)
from llmrun.server.stops import StopWatch
from llmrun.text_to_text import Options

# llama.cpp's seeds that ask for a random one: -1, and LLAMA_DEFAULT_SEED.
RANDOM_SEEDS = (-1, 0xFFFFFFFF)


class NativeBody(Sampling):
    """The /completion fields llmrun honours besides the sampling ones: `n_predict` (-1:
    until the context is full; OpenAI's max_tokens is taken too), `n_probs` (the most
    likely tokens at each step), `return_tokens` (the generated ids), `response_fields`
    (the paths, such as "timings/prompt_n", of the fields to answer with)."""

    n_predict: Annotated[int, Field(ge=-1)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0
    return_tokens: bool = False
    response_fields: Annotated[list[str], Field(max_length=64)] = []

    def limit(self) -> int | None:
        """The most tokens to generate; None: until the context is full."""
        limit = self.max_tokens if self.n_predict is None else self.n_predict
        if limit == 0:
            raise ApiError(400, "n_predict 0 asks for nothing to be generated", param="n_predict")
        return None if limit == -1 else limit


class CompletionBody(NativeBody, TextToTextFields):
    """POST /completion: one prompt, as text, token ids, or both mixed; `grammar` (GBNF)
    or `json_schema` constrain the reply; a text-to-text model's beams and languages. `cache_prompt` is accepted: serve keeps every
    prompt's blocks for reuse unless started with --no-prefix-cache."""

    prompt: str | Annotated[list[Any], Field(min_length=1)]
    cache_prompt: bool = True
    grammar: str | None = None
    json_schema: dict[str, Any] | bool | None = None


class TokenizeBody(Body):
    content: str | Annotated[list[Any], Field(min_length=1)]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(Body):
    tokens: list[int] = []


class TemplateBody(ChatBody):
    """/apply-template's request: /v1/chat/completions' messages (and tools)."""


# --- prompts and tokens -----------------------------------------------------------------


def prompt_ids(
    tokenizer,
    prompt: str | list[Any],
    add_bos: bool | None = None,
    parse_special: bool = True,
    param: str = "prompt",
) -> list[int]:
    """A prompt (the request's field `param`) of text, token ids, or both mixed, as
    llama.cpp's tokenize_mixed reads it: BOS (where the model adds one and `add_bos` is
    None) only before text that begins it."""
    parts = [prompt] if isinstance(prompt, str) else prompt
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            bos = add_bos if i == 0 else False
            ids += tokenizer.encode(part, add_bos=bos, parse_special=parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            if not 0 <= part < tokenizer.vocab_size:
                raise ApiError(
                    400,
                    f"{param}.{i}: token ids must be in [0, {tokenizer.vocab_size})",
                    param=f"{param}.{i}",
                )
            ids.append(part)
        else:
            raise ApiError(
                400, f"{param}.{i}: a token id or a text, got {part!r}", param=f"{param}.{i}"
            )
    return ids


def _piece(tokenizer, token: int) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (as llama.cpp gives it)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def tokenize(request: Request) -> Response:
    """POST /tokenize: `content`'s ids (BOS only with `add_special`), or id/piece pairs."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, TokenizeBody)
    tokenizer = service.ready_engine(None).tokenizer
    add_bos = None if body.add_special else False
    ids = await asyncio.to_thread(
        prompt_ids, tokenizer, body.content, add_bos, body.parse_special, "content"
    )
    if body.with_pieces:
        return JSONResponse({"tokens": [{"id": i, "piece": _piece(tokenizer, i)} for i in ids]})
    return JSONResponse({"tokens": ids})


async def detokenize(request: Request) -> Response:
    """POST /detokenize: the text of `tokens`, each piece as it is, control tokens too."""
    service: Service = request.app.state.service
    service.authorize(request)
    body = await read_json(request, DetokenizeBody)
    tokenizer = service.ready_engine(None).tokenizer
    raw = b"".join(tokenizer.token_bytes(token) for token in body.tokens)
    return JSONResponse({"content": raw.decode("utf-8", "replace")})


async def apply_template(request: Request) -> Response:
    """POST /apply-template: the prompt /v1/chat/completions renders for the messages."""
    service, body, engine = await begin(request, TemplateBody)
    check_tools(body.tools, body.tool_choice)
    messages = [message.as_dict() for message in body.messages]
    check_history(messages)
    choice = body.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    ask = Ask(
        messages,
        tools=[t.as_dict() for t in body.tools or []],
        tool_choice=choice,
        switches=engine.switches(effort=body.reasoning_effort, kwargs=body.chat_template_kwargs),
    )
    prepared = await asyncio.to_thread(prepare, engine, service.tool_format, ask)
    return JSONResponse({"prompt": prepared.text})


def settings(params: SamplingParams, limit: int | None, stop: list[str], n_probs: int) -> dict:
    """llama.cpp's generation settings ("params") of a request, in its names."""
    return {
        "n_predict": -1 if limit is None else limit,
        "seed": 0xFFFFFFFF if params.seed is None else params.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_last_n": params.repeat_last_n,
        "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": stop,
        "max_tokens": -1 if limit is None else limit,
        "n_probs": n_probs,
        "grammar": "",
    }


async def props(request: Request) -> Response:
    """GET /props: the server's settings, as llama.cpp's web UI and scripts read them."""
    service: Service = request.app.state.service
    service.authorize(request)
    engine = service.ready_engine(None)
    template = engine.template.source if engine.template is not None else ""
    return JSONResponse(
        {
            "default_generation_settings": {
                "n_ctx": engine.ctx_size,
                "params": settings(engine.defaults, None, [], 0),
            },
            "total_slots": service.parallel,
            "model_alias": service.model_id,
            "model_path": str(engine.path),
            "chat_template": template,
            "modalities": {"vision": engine.vision is not None, "audio": engine.audio is not None},
            "bos_token": _special_text(engine.tokenizer, engine.tokenizer.bos_id),
            "eos_token": _special_text(engine.tokenizer, (engine.eos_ids or [None])[0]),
            "build_info": f"llmrun-{__version__}",
            "is_sleeping": False,
        }
    )


def _special_text(tokenizer, token: int | None) -> str:
    return "" if token is None else tokenizer.token_to_piece(token)


# --- /completion ------------------------------------------------------------------------


async def completion(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, CompletionBody)
    if body.seed in RANDOM_SEEDS:
        body.seed = None
    params, stop = sampling_of(engine, body)
    limit = body.limit()
    prompt = body.prompt
    if isinstance(prompt, list) and (
        len(prompt) > 1
        and all(isinstance(part, str) for part in prompt)
        or any(isinstance(part, (list, dict)) for part in prompt)
    ):
        raise ApiError(
            400,
            "prompt: one prompt at a time here (text, token ids, or both mixed); send several "
            "to /v1/completions",
            param="prompt",
        )
    ids = await asyncio.to_thread(prompt_ids, engine.tokenizer, prompt)
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    grammar = await asyncio.to_thread(_grammar, engine, body)
    if grammar is not None:
        params = params.updated(grammar=grammar)
    return await complete(
        request,
        service,
        engine,
        body,
        ids,
        params,
        stop,
        limit,
        "completion",
        arrived,
        options_of(engine, body),
    )


def _grammar(engine: api.Engine, body: CompletionBody) -> Any:
    """The grammar of `grammar` (GBNF) or `json_schema` ({} or true: any JSON), or None."""
    if body.grammar is None and body.json_schema is None:
        return None
    if body.grammar is not None and body.json_schema is not None:
        raise ApiError(400, "give grammar or json_schema, not both", param="grammar")
    from llmrun import structured

    vocab = structured.vocabulary(engine.tokenizer, engine.eos_ids)
    try:
        if body.grammar is not None:
            return vocab.gbnf(body.grammar, "grammar")
        schema = body.json_schema if isinstance(body.json_schema, dict) else {}
        return vocab.json_schema(schema or None, "json_schema")
    except structured.GrammarError as e:
        param = "grammar" if body.grammar is not None else "json_schema"
        raise ApiError(400, str(e), param=param) from None


async def complete(
    request: Request,
    service: Service,
    engine: api.Engine,
    body: NativeBody,
    ids: list[int],
    params: SamplingParams,
    stop: list[str],
    limit: int | None,
    endpoint: str,
    arrived: float,
    options: Options | None = None,
) -> Response:
    """Generate after `ids` and answer in llama.cpp's /completion shape, streamed with
    `body.stream`; `options`: a text-to-text model's beams and languages."""
    tokenizer = engine.tokenizer
    job = batching.Request(
        ids,
        params,
        limit,
        stop,
        body.n_probs or None,
        body.ignore_eos,
        lora=request_lora(engine, body),
        text_to_text=options,
    )
    gen = Generation(service, endpoint, [job], arrived)
    watch = StopWatch(tokenizer, ids, stop)
    sent = {"tokens": 0, "text": ""}  # what was generated so far

    def note(event: GenResponse) -> None:
        watch.feed(event)
        sent["tokens"] += event.token is not None
        sent["text"] += event.text

    def partial(event: GenResponse) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": 0,
            "content": event.text,
            "tokens": [event.token] if event.token is not None else [],
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": event.stats.completion_tokens,
            "tokens_evaluated": event.stats.prompt_tokens,
        }
        if body.n_probs:
            out["completion_probabilities"] = _probs(tokenizer, event)
        return out

    def final(
        event: GenResponse, content: str, tokens: list[int], probs: list | None = None
    ) -> dict[str, Any]:
        stats = event.stats
        word = watch.word() if event.finish_reason == "stop" else None
        stop_type = "limit" if event.finish_reason == "length" else "word" if word else "eos"
        result = {
            "index": 0,
            "content": content,
            "tokens": tokens if body.return_tokens else [],
            "id_slot": 0,
            "stop": True,
            "model": service.model_id,
            "tokens_predicted": stats.completion_tokens,
            "tokens_evaluated": stats.prompt_tokens,
            "generation_settings": settings(params, limit, stop, body.n_probs),
            "prompt": tokenizer.decode(ids, skip_special=False),
            "has_new_line": "\n" in sent["text"],
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word or "",
            "tokens_cached": stats.prompt_tokens - stats.prompt_processed,
            "timings": _timings(event),
        }
        if probs:
            result["completion_probabilities"] = probs
        return _fields(body.response_fields, result) if body.response_fields else result

    if body.stream:

        async def lines() -> AsyncIterator[str]:
            try:
                async for _, event in gen.events():
                    note(event)
                    if event.finish_reason is None:
                        yield _json(partial(event))
                        continue
                    if event.text or event.logprobs:
                        yield _json(partial(event))
                    yield _json(final(event, "", []))
            except Exception as e:
                error = as_api_error(e, "prompt")
                gen.metrics.requests.labels(endpoint, str(error.status)).inc()
                yield _json(error.body())

        return EventSourceResponse(lines(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE)

    tokens: list[int] = []
    probs: list[dict[str, Any]] = []
    last = None
    async for _, event in gen.events(request.is_disconnected):
        note(event)
        tokens += [event.token] if event.token is not None else []
        probs += _probs(tokenizer, event) if body.n_probs else []
        last = event
    if not gen.done:
        return Response(status_code=499)
    return JSONResponse(final(last, sent["text"], tokens, probs))


def _probs(tokenizer, event: GenResponse) -> list[dict[str, Any]]:
    """llama.cpp's completion_probabilities of the event's tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token)
        return {
            "id": token,
            "token": raw.decode("utf-8", "ignore"),
            "bytes": list(raw),
            "logprob": logprob,
        }

    return [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in event.logprobs
    ]


def _fields(paths: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's json_get_nested_values: each path that leads somewhere, and its value."""
    out = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not (isinstance(value, dict) and key in value):
                break
            value = value[key]
        else:
            out[path] = value
    return out


def _timings(event: GenResponse) -> dict[str, Any]:
    """llama.cpp's timings of a finished request."""
    s = event.stats
    prompt_ms, predicted_ms = s.prompt_seconds * 1e3, s.generation_seconds * 1e3
    timings = {
        "cache_n": s.prompt_tokens - s.prompt_processed,
        "prompt_n": s.prompt_processed,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / s.prompt_processed if s.prompt_processed else 0.0,
        "prompt_per_second": s.prompt_tps,
        "predicted_n": s.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / s.completion_tokens
        if s.completion_tokens
        else 0.0,
        "predicted_per_second": s.generation_tps,
    }
    if s.drafted:  # speculative decoding's counts, as llama.cpp gives them
        timings |= {"draft_n": s.drafted, "draft_n_accepted": s.accepted}
    return timings


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
