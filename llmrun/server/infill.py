"""POST /infill: llama.cpp's code-completion endpoint, which editor plugins (llama.vscode,
llama.vim) call: the code around the cursor and other files in, the middle out, in
llama.cpp's /completion response shape (server-sent events with `stream`, ending without
OpenAI's [DONE], as llama.cpp's do)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import api, batching
from llmrun.generate import Response as GenResponse
from llmrun.infill import infill_ids
from llmrun.server.lora import request_lora
from llmrun.server.schema import ApiError, Sampling, as_api_error
from llmrun.server.service import SHUTDOWN_GRACE, Generation, begin, sampling_of


class ExtraFile(BaseModel):
    """One of `input_extra`: another file's text, and its name (llama.cpp's default)."""

    filename: str = "tmp"
    text: str


class InfillBody(Sampling):
    """llama.cpp's /infill request, with the /completion fields llmrun honours:
    `n_predict` (-1: until the context is full), `n_probs` (the most likely tokens at each
    step), `return_tokens` (the generated ids)."""

    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraFile] = []
    prompt: str = ""
    n_predict: Annotated[int, Field(ge=-1)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0
    return_tokens: bool = False
    # Paths ("timings/prompt_n") of the fields the final answer keeps, as keys (llama.vim's).
    response_fields: Annotated[list[str], Field(max_length=64)] = []


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


async def infill(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, InfillBody)
    params, stop = sampling_of(engine, body)
    limit = body.max_tokens if body.n_predict is None else body.n_predict
    if limit == 0:
        raise ApiError(400, "n_predict 0 asks for nothing to be generated", param="n_predict")
    limit = None if limit == -1 else limit
    tokenizer = engine.tokenizer
    extra = [(file.filename, file.text) for file in body.input_extra]
    ids = await asyncio.to_thread(
        infill_ids,
        tokenizer,
        service.model_id,
        body.input_prefix,
        body.input_suffix,
        extra,
        body.prompt,
        ctx_size=engine.ctx_size,
        max_tokens=limit,
    )
    job = batching.Request(
        ids,
        params,
        limit,
        stop,
        body.n_probs or None,
        body.ignore_eos,
        lora=request_lora(engine, body),
    )
    gen = Generation(service, "infill", [job], arrived)
    sent = {"tokens": 0, "text": ""}  # what was generated so far

    def partial(event: GenResponse) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": 0,
            "content": event.text,
            "tokens": [event.token] if body.return_tokens and event.token is not None else [],
            "stop": False,
            "tokens_predicted": event.stats.completion_tokens,
            "tokens_evaluated": event.stats.prompt_tokens,
        }
        if body.n_probs:
            out["completion_probabilities"] = _probs(tokenizer, event)
        return out

    def note(event: GenResponse) -> None:
        sent["tokens"] += event.token is not None
        sent["text"] += event.text

    def final(
        event: GenResponse, content: str, tokens: list[int], probs: list | None = None
    ) -> dict[str, Any]:
        stats = event.stats
        # An end-of-generation token counts among the completion tokens but is never sent.
        ended = event.finish_reason == "stop" and stats.completion_tokens > sent["tokens"]
        stop_type = "limit" if event.finish_reason == "length" else "eos" if ended else "word"
        result = {
            "index": 0,
            "content": content,
            "tokens": tokens if body.return_tokens else [],
            "stop": True,
            "model": service.model_id,
            "tokens_predicted": stats.completion_tokens,
            "tokens_evaluated": stats.prompt_tokens,
            "prompt": tokenizer.decode(ids, skip_special=False),
            "has_new_line": "\n" in sent["text"],
            "truncated": False,
            "stop_type": stop_type,
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
                error = as_api_error(e, "input_prefix")
                gen.metrics.requests.labels("infill", str(error.status)).inc()
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


def suffix_prompts(
    engine: api.Engine, name: str, prompt: str | list, suffix: str, max_tokens: int | None
) -> list[list[int]]:
    """/v1/completions with a `suffix` (OpenAI's insert mode): each text prompt is the
    prefix of a FIM prompt."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    texts = prompt if many else [prompt]
    if not all(isinstance(text, str) for text in texts):
        raise ApiError(400, "a suffix goes with text prompts, not token ids", param="suffix")
    tokenizer, ctx_size = engine.tokenizer, engine.ctx_size
    return [
        infill_ids(tokenizer, name, text, suffix, ctx_size=ctx_size, max_tokens=max_tokens)
        for text in texts
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
