"""`/v1/messages`: Anthropic's Messages API, for agents and Claude-style clients.

A request's `system`, `messages` (text, image, tool_use, tool_result and thinking blocks)
and `tools` (name, description, input_schema) become the conversation the chat endpoints
render, with its images as they take them (llmrun.server.images: base64 only); `tool_choice`
auto, any, tool or none; `thinking` switches a reasoning model's thinking on or off where
its template has the switch (`budget_tokens` is not enforced); `output_config.format` a
JSON schema the reply follows. The reply's content blocks are its thinking, text and
tool_use in the order the model wrote them; a stream is Anthropic's events (message_start,
content_block_start, ping, content_block_delta, content_block_stop, message_delta,
message_stop), each block closed before the next opens. Errors come in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`. `/v1/messages/count_tokens` counts a
request's prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import api, batching
from llmrun.chat import PLAIN_STOP
from llmrun.generate import Response as GenResponse
from llmrun.server.images import check_body, image_refs, read_images
from llmrun.server.lora import request_lora
from llmrun.server.reply import Ask, Prepared, ReplyReader, is_reasoning, prepare
from llmrun.server.schema import (
    ApiError,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Sampling,
    StopText,
    Tool,
    as_api_error,
    check_tools,
)
from llmrun.server.service import (
    MAX_BODY_BYTES,
    MAX_IMAGE_BODY_BYTES,
    SHUTDOWN_GRACE,
    Generation,
    Service,
    begin,
    sampling_of,
)
from llmrun.server.stops import StopWatch
from llmrun.tool_calls import Item, ToolCall

# Anthropic's error type for each HTTP status llmrun answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# --- the request ------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ImageBlock(BaseModel):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageIn(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(BaseModel):
    """A tool: a custom one (name, description, input_schema), or one of Anthropic's own,
    named by its type, which llmrun cannot run."""

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoiceIn(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingIn(BaseModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    format: OutputFormat | None = None


class CountBody(Sampling):
    """What /v1/messages/count_tokens reads: a Messages request less max_tokens."""

    messages: Annotated[list[MessageIn], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopText], Field(max_length=16)] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesBody(CountBody):
    max_tokens: Annotated[int, Field(ge=1)]


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)  # as chat's content parts


def conversation(body: CountBody) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages: tool_use blocks go to an
    assistant message's tool_calls, tool_result blocks to tool messages (before the user's
    text, as Anthropic orders them), thinking blocks to the assistant's reasoning, image
    blocks to image parts (llmrun.server.images reads them)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _joined(body.system)
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        parts: list[Any] = []  # text blocks and image parts, in order
        results, tool_calls, reasoning = [], [], []
        for j, block in enumerate(message.content):
            at = f"{where}.{j}"
            if isinstance(block, (ToolUseBlock, ToolResultBlock, ThinkingBlock)):
                wanted = "tool_result" if message.role == "user" else "text, tool_use, thinking"
                if (message.role == "user") != isinstance(block, ToolResultBlock):
                    raise ApiError(
                        400,
                        f"{at}: a {message.role} message holds {wanted} blocks, not {block.type}",
                        param=f"{at}.type",
                    )
            if isinstance(block, TextBlock):
                parts.append(block)
            elif isinstance(block, ImageBlock):
                parts.append({"type": "image", "url": _image_url(block, at), "param": at})
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.add(block.id)
                arguments = json.dumps(block.input, ensure_ascii=False)
                tool_calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                results.append(_tool_message(block, calls, at))
            # else redacted thinking: encrypted for Anthropic's models, nothing to render
        messages += results
        texts = [part for part in parts if isinstance(part, TextBlock)]
        if message.role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": _joined(texts)}
            if reasoning:
                reply["reasoning_content"] = "".join(reasoning)
            if tool_calls:
                reply["tool_calls"] = tool_calls
            messages.append(reply)
        elif len(texts) < len(parts):
            content = [
                {"type": "text", "text": part.text} if isinstance(part, TextBlock) else part
                for part in parts
            ]
            messages.append({"role": "user", "content": content})
        elif texts or not results:
            messages.append({"role": "user", "content": _joined(texts)})
    return messages


def _image_url(block: ImageBlock, at: str) -> str:
    """An image block's source as the URL chat's image parts carry: base64 data as a
    data: URL; a url source as it is (serve fetches nothing, and says so)."""
    source = block.source
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type', '')};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(
        400, f"{at}.source: an image source is base64 data or a url", param=f"{at}.source"
    )


def _tool_message(block: ToolResultBlock, calls: set[str], at: str) -> dict[str, Any]:
    if block.tool_use_id not in calls:
        raise ApiError(
            400,
            f"{at}: the tool_result answers tool_use_id {block.tool_use_id!r}, but no earlier "
            "tool_use block has that id",
            param=f"{at}.tool_use_id",
        )
    content = block.content
    if not isinstance(content, str) and any(isinstance(p, ImageBlock) for p in content):
        raise ApiError(
            400, f"{at}.content: images in a tool_result are not supported", param=f"{at}.content"
        )
    text = content if isinstance(content, str) else _joined(content)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def messages_ask(engine: api.Engine, body: CountBody) -> Ask:
    """What a Messages request asks, checked (tools, tool_choice, thinking)."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom") or tool.input_schema is None:
            kind = tool.type or "a tool without an input_schema"
            raise ApiError(
                400,
                f"tools.{i}: only custom tools (name, description, input_schema) can be "
                f"called here, not {kind}",
                param=f"tools.{i}",
            )
        function = FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        tools.append(Tool(type="function", function=function))
    choice: Any = None
    parallel = True
    if body.tool_choice is not None:
        picked = body.tool_choice
        parallel = not picked.disable_parallel_tool_use
        if picked.type == "tool":
            if picked.name is None:
                raise ApiError(
                    400, "tool_choice of type tool needs a name", param="tool_choice.name"
                )
            choice = NamedToolChoice(type="function", function=NamedFunction(name=picked.name))
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[picked.type]
    check_tools(tools, choice)
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    output = body.output_config.format if body.output_config is not None else None
    return Ask(
        conversation(body),
        tools=[t.as_dict() for t in tools],
        tool_choice=choice or "auto",
        parallel=parallel,
        schema=output.schema_ if output is not None else None,
        schema_param="output_config.format.schema",
        switches=engine.switches(think=_think(engine, body), kwargs=body.chat_template_kwargs),
    )


def _think(engine: api.Engine, body: CountBody) -> bool | None:
    """Thinking on (enabled) or off (disabled) where the template has the switch; else,
    and for adaptive thinking, the model does as it does by default."""
    kind = body.thinking.type if body.thinking is not None else None
    if kind not in ("enabled", "disabled") or engine.template is None:
        return None
    if not {"enable_thinking", "thinking"} & engine.template.variables:
        return None
    return kind == "enabled"


# --- the reply, as content blocks and events --------------------------------------------


class Blocks:
    """Builds a reply's content blocks from its items, and the stream events that tell a
    client each step; the same for a stream and a whole message."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the thinking or text block being written

    def add(self, item: Item) -> list[dict[str, Any]]:
        if isinstance(item, ToolCall):
            events = self.close()
            index = len(self.content)
            block = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
            events.append(
                {"type": "content_block_start", "index": index, "content_block": dict(block)}
            )
            block["input"] = json.loads(item.arguments)
            self.content.append(block)
            delta = {"type": "input_json_delta", "partial_json": item.arguments}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
            events.append({"type": "content_block_stop", "index": index})
            return events
        text = str(item)
        if not text:
            return []
        kind, field = ("thinking", "thinking") if is_reasoning(item) else ("text", "text")
        events = [] if self.open is not None and self.open["type"] == kind else self.close()
        if self.open is None:
            block: dict[str, Any] = {"type": kind, field: ""}
            if kind == "thinking":
                block["signature"] = ""  # Anthropic's proof of its own thinking; none here
            events.append(
                {
                    "type": "content_block_start",
                    "index": len(self.content),
                    "content_block": dict(block),
                }
            )
            self.content.append(block)
            self.open = block
        self.open[field] += text
        delta = {"type": f"{kind}_delta", field: text}
        events.append(
            {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        )
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def _usage(final: GenResponse) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
    stats = final.stats
    cached = stats.prompt_tokens - stats.prompt_processed
    return {
        "input_tokens": stats.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": stats.completion_tokens,
    }


class _Reply:
    """One reply's events -> content blocks (and their stream events), and why it ended."""

    def __init__(
        self, engine: api.Engine, prepared: Prepared, stops: list[str], sequences: list[str]
    ) -> None:
        self.reader = ReplyReader(engine, prepared)
        self.watch = StopWatch(engine.tokenizer, prepared.ids, stops)
        self.sequences = sequences
        self.blocks = Blocks()

    def feed(self, event: GenResponse) -> list[dict[str, Any]]:
        self.watch.feed(event)
        out = [e for item in self.reader.feed(event) for e in self.blocks.add(item)]
        if event.finish_reason is not None:
            out += self.blocks.close()
        return out

    def stop_reason(self, final: GenResponse) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence (call once, at the end)."""
        if self.reader.calls and final.finish_reason == "stop":
            return "tool_use", None
        if final.finish_reason == "length":
            return "max_tokens", None
        word = self.watch.word()
        if word is not None and word in self.sequences:
            return "stop_sequence", word
        return "end_turn", None

    def result(self, final: GenResponse) -> dict[str, Any]:
        """The message's content, why it ended, and its usage (once, at the end)."""
        reason, sequence = self.stop_reason(final)
        return {
            "content": self.blocks.content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(final),
        }


# --- the endpoints ----------------------------------------------------------------------


async def _prepared(request: Request, schema: type[CountBody]) -> tuple[Any, ...]:
    """The request checked, its images encoded, its prompt rendered and encoded."""
    service, body, engine = await begin(request, schema, MAX_IMAGE_BODY_BYTES)
    ask = messages_ask(engine, body)
    refs = image_refs(ask.messages, "messages")
    check_body(request, refs, MAX_BODY_BYTES)
    pictures = await read_images(engine, service.image_encoder, service.model_id, refs)
    if pictures is not None:
        ask.images = pictures.embeds
    prepared = await asyncio.to_thread(prepare, engine, service.tool_format, ask)
    return service, body, engine, prepared, pictures


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens, tools and system included."""
    _, _, _, prepared, _ = await _prepared(request, CountBody)
    return JSONResponse({"input_tokens": len(prepared.ids)})


async def messages(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine, prepared, pictures = await _prepared(request, MessagesBody)
    params, stop = sampling_of(engine, body)
    stop += body.stop_sequences or []
    if engine.template is None:
        stop.append(PLAIN_STOP)
    if prepared.grammar is not None:
        params = params.updated(grammar=prepared.grammar)
    stops = prepared.stops(stop)
    gen_request = batching.Request(
        prepared.ids,
        params,
        body.max_tokens,
        stops,
        history_end=prepared.history_end,
        lora=request_lora(engine, body),
        images=prepared.images,
        image_digests=pictures.digests if pictures is not None else (),
    )
    gen = Generation(service, "messages", [gen_request], arrived)
    reply = _Reply(engine, prepared, stops, body.stop_sequences or [])
    head = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": service.model_id,
    }

    if body.stream:
        return EventSourceResponse(
            _stream(gen, head, reply), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE
        )
    async for _, event in gen.events(request.is_disconnected):
        reply.feed(event)
    if not gen.done:
        return Response(status_code=499)
    return JSONResponse({**head, **reply.result(gen.finals[0])})


async def _stream(
    gen: Generation, head: dict[str, Any], reply: _Reply
) -> AsyncIterator[ServerSentEvent]:
    def sse(event: dict[str, Any]) -> ServerSentEvent:
        return ServerSentEvent(
            json.dumps(event, ensure_ascii=False, separators=(",", ":")), event=event["type"]
        )

    # Anthropic pings once the first block opens (here also before the end, if none does).
    started = pinged = False
    try:
        async for _, event in gen.events():
            if not started:  # the prompt is in: its usage is known
                started = True
                start = {
                    **head,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {**_usage(event), "output_tokens": 0},
                }
                yield sse({"type": "message_start", "message": start})
            for item in reply.feed(event):
                yield sse(item)
                if not pinged and item["type"] == "content_block_start":
                    pinged = True
                    yield sse({"type": "ping"})
        if not pinged:
            yield sse({"type": "ping"})
        result = reply.result(gen.finals[0])
        delta = {"stop_reason": result["stop_reason"], "stop_sequence": result["stop_sequence"]}
        yield sse({"type": "message_delta", "delta": delta, "usage": result["usage"]})
        yield sse({"type": "message_stop"})
    except Exception as e:
        error = as_api_error(e)
        gen.metrics.requests.labels(gen.endpoint, str(error.status)).inc()
        yield sse(_error_body(error))


def _error_body(error: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else None)
    return {
        "type": "error",
        "error": {"type": kind or "invalid_request_error", "message": error.message},
    }


def endpoint(handler: Callable, name: str) -> Callable:
    """`handler` with every failure answered in Anthropic's error shape (and counted)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            error = as_api_error(e, "messages")
            service: Service = request.app.state.service
            service.metrics.requests.labels(name, str(error.status)).inc()
            return JSONResponse(_error_body(error), status_code=error.status, headers=error.headers)

    return wrapped
