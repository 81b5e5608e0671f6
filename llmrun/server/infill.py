"""POST /infill: llama.cpp's code-completion endpoint, which editor plugins (llama.vscode,
llama.vim) call: the code around the cursor and other files in, the middle out, in
llama.cpp's /completion response shape (llama_server.complete: server-sent events with
`stream`, ending without OpenAI's [DONE], as llama.cpp's do)."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from llmrun import api
from llmrun.infill import infill_ids
from llmrun.server.llama_server import NativeBody, complete
from llmrun.server.schema import ApiError
from llmrun.server.service import begin, sampling_of


class ExtraFile(BaseModel):
    """One of `input_extra`: another file's text, and its name (llama.cpp's default)."""

    filename: str = "tmp"
    text: str


class InfillBody(NativeBody):
    """llama.cpp's /infill request: the code before and after the cursor, other files,
    and a `prompt` that the middle begins with."""

    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraFile] = []
    prompt: str = ""


async def infill(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, InfillBody)
    params, stop = sampling_of(engine, body)
    limit = body.limit()
    extra = [(file.filename, file.text) for file in body.input_extra]
    ids = await asyncio.to_thread(
        infill_ids,
        engine.tokenizer,
        service.model_id,
        body.input_prefix,
        body.input_suffix,
        extra,
        body.prompt,
        ctx_size=engine.ctx_size,
        max_tokens=limit,
    )
    return await complete(
        request, service, engine, body, ids, params, stop, limit, "infill", arrived
    )


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
