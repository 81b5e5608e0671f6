"""`/v1/responses`: OpenAI's Responses API, stateless, as local servers offer it.

`input` is a string or a list of items (messages, `function_call`, `function_call_output`,
`reasoning`), `instructions` the system message, `tools` flat function tools, `text.format`
a structured output, `reasoning.effort` the template's switch. The reply's output items are
its reasoning, its message and its function calls, in the order the model wrote them; a
stream is the documented events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each item closed before the next opens, so that the events rebuild
exactly the response that a request without `stream` gets. Nothing is stored: a
`previous_response_id` or `store: true` is a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmrun import batching
from llmrun.chat import PLAIN_STOP
from llmrun.generate import Response as GenResponse
from llmrun.reasoning import REASONING
from llmrun.server.images import check_body, image_refs, read_images
from llmrun.server.lora import request_lora
from llmrun.server.reply import Ask, ReplyReader, is_reasoning, prepare
from llmrun.server.schema import (
    ApiError,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Sampling,
    Tool,
    as_api_error,
    check_tools,
)
from llmrun.server.service import (
    MAX_BODY_BYTES,
    MAX_IMAGE_BODY_BYTES,
    SHUTDOWN_GRACE,
    Generation,
    begin,
    sampling_of,
)
from llmrun.tool_calls import Item, ToolCall

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> Tool:
        fields = self.model_dump(exclude={"type"})
        return Tool(type="function", function=FunctionDef(**fields))


class OtherTool(BaseModel):
    type: str


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesBody(Sampling):
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool | OtherTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# --- the request, as a conversation ----------------------------------------------------


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be text or a list of text parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}.{i}: only text parts (input_text, output_text) are supported, got "
                f"{kind!r}",
                param=f"{where}.{i}",
            )
        parts.append(part["text"])
    return "\n".join(parts)  # as chat's content parts


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as _text makes it, or, where it has input_image parts, its
    parts in order as chat's Message.as_dict gives them (llmrun.server.images)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ApiError(
                    400,
                    f"{where}.{j}: an input_image needs an image_url (a base64 data: URL); "
                    "llmrun keeps no files",
                    param=f"{where}.{j}.image_url",
                )
            parts.append({"type": "image", "url": url, "param": f"{where}.{j}.image_url"})
        elif (
            isinstance(part, dict)
            and part.get("type") in TEXT_PARTS
            and isinstance(part.get("text"), str)
        ):
            parts.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            raise ApiError(
                400,
                f"{where}.{j}: only text and image parts (input_text, input_image) are "
                f"supported, got {kind!r}",
                param=f"{where}.{j}",
            )
    return parts


def conversation(body: ResponsesBody) -> list[dict[str, Any]]:
    """The request's instructions and input items as chat messages: calls go to an
    assistant message's tool_calls, their outputs to tool messages, reasoning items to
    the reasoning of the assistant message that follows them."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    calls: set[str] = set()
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"], reasoning = reasoning, None
        return last

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(
                    400, f"{where}.role: must be one of {', '.join(ROLES)}", param=f"{where}.role"
                )
            if role == "assistant":
                message = assistant()
                message["content"] += _text(item.get("content", ""), f"{where}.content")
            else:
                content = _content(item.get("content", ""), f"{where}.content")
                messages.append(
                    {"role": "system" if role == "developer" else role, "content": content}
                )
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
            if not (
                isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)
            ):
                raise ApiError(
                    400, f"{where}: a function_call needs name, call_id and arguments", param=where
                )
            calls.add(call_id)
            message = assistant()
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            message.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(output, str):
                output = _text(output, f"{where}.output") if isinstance(output, list) else None
            if not isinstance(call_id, str) or output is None:
                raise ApiError(
                    400, f"{where}: a function_call_output needs call_id and output", param=where
                )
            if call_id not in calls:
                raise ApiError(
                    400,
                    f"{where}: the function_call_output answers call_id {call_id!r}, but no "
                    "earlier function_call made that call",
                    param=f"{where}.call_id",
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "item_reference":
            raise ApiError(
                400,
                f"{where}: llmrun stores no responses, so an item_reference has nothing to refer "
                "to: send the items themselves",
                param=where,
            )
        else:
            raise ApiError(
                400, f"{where}: unsupported input item type {kind!r}", param=f"{where}.type"
            )
    if not messages or all(m["role"] == "system" for m in messages):
        raise ApiError(400, "input has no message for the model to answer", param="input")
    return messages


def responses_ask(engine: Any, body: ResponsesBody) -> Ask:
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "llmrun's /v1/responses is stateless: it keeps no earlier responses, so "
            "previous_response_id cannot be used; send the whole conversation in input",
            param="previous_response_id",
        )
    if body.store:
        raise ApiError(
            400,
            "llmrun's /v1/responses is stateless: it stores nothing, so store must be false "
            "or left out",
            param="store",
        )
    tools = []
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, FunctionTool):
            raise ApiError(
                400,
                f"tools.{i}: only function tools are supported, not {tool.type!r}",
                param=f"tools.{i}.type",
            )
        tools.append(tool.as_chat())
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    check_tools(tools, choice)
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
    schema = None
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        schema = {}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(
                400, "text.format of type json_schema needs a schema", param="text.format"
            )
        schema = fmt.schema_
    effort = body.reasoning.effort if body.reasoning is not None else None
    return Ask(
        conversation(body),
        tools=[t.as_dict() for t in tools],
        tool_choice=choice or "auto",
        parallel=body.parallel_tool_calls is not False,
        schema=schema,
        schema_param="text.format.schema",
        switches=engine.switches(effort=effort, kwargs=body.chat_template_kwargs),
    )


# --- the output, as items and events ---------------------------------------------------


class Output:
    """Builds a response's output items from a reply's items, and the stream events that
    tell a client each step; the same for a stream and a whole response."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written

    def add(self, item: Item) -> list[dict[str, Any]]:
        if isinstance(item, ToolCall):
            events = self.close()
            call = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": item.id,
                "name": item.name,
                "arguments": "",
                "status": "in_progress",
            }
            index = len(self.items)
            self.items.append(call)
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": dict(call)}
            )
            call.update(arguments=item.arguments, status="completed")
            where = {"item_id": call["id"], "output_index": index}
            events += [
                {
                    "type": "response.function_call_arguments.delta",
                    **where,
                    "delta": item.arguments,
                },
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item.name,
                    "arguments": item.arguments,
                },
                {"type": "response.output_item.done", "output_index": index, "item": dict(call)},
            ]
            return events
        text = str(item)
        if not text:
            return []
        kind = "reasoning" if is_reasoning(item) else "message"
        events = [] if self._open is not None and self._open["type"] == kind else self.close()
        if self._open is None:
            events += self._start(kind)
        part = self._open["content"][0]
        part["text"] += text
        delta = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        event = {"type": delta, **self._where(), "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item.update(status="in_progress", content=[])
        index = len(self.items)
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": index, "item": _copy(item)}
        item["content"].append(part)
        self._open = item
        part_added = {"type": "response.content_part.added", **self._where(), "part": _copy(part)}
        return [added, part_added]

    def _where(self) -> dict[str, Any]:
        item = self._open
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Finish the reasoning or message being written (`status` "incomplete": cut off
        by max_output_tokens): its done events."""
        item = self._open
        if item is None:
            return []
        where = self._where()
        self._open = None
        part = item["content"][0]
        done = (
            "response.reasoning_text.done"
            if item["type"] == "reasoning"
            else "response.output_text.done"
        )
        item["status"] = status
        index = where["output_index"]
        return [
            {"type": done, **where, "text": part["text"]},
            {"type": "response.content_part.done", **where, "part": _copy(part)},
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


# --- the endpoint --------------------------------------------------------------------


async def responses(request: Request) -> Response:
    arrived = time.perf_counter()
    service, body, engine = await begin(request, ResponsesBody, MAX_IMAGE_BODY_BYTES)
    ask = responses_ask(engine, body)
    refs = image_refs(ask.messages, "input")
    check_body(request, refs, MAX_BODY_BYTES)
    pictures = await read_images(engine, service.image_encoder, service.model_id, refs)
    if pictures is not None:
        ask.images = pictures.embeds
    params, stop = sampling_of(engine, body)
    if engine.template is None:
        stop.append(PLAIN_STOP)
    prepared = await asyncio.to_thread(prepare, engine, service.tool_format, ask)
    if prepared.grammar is not None:
        params = params.updated(grammar=prepared.grammar)
    reader = ReplyReader(engine, prepared)
    gen_request = batching.Request(
        prepared.ids,
        params,
        body.max_output_tokens,
        prepared.stops(stop),
        history_end=prepared.history_end,
        lora=request_lora(engine, body),
        images=prepared.images,
        image_digests=pictures.digests if pictures is not None else (),
    )
    gen = Generation(service, "responses", [gen_request], arrived)
    output = Output()
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    response: dict[str, Any] = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": service.model_id,
        "output": [],
        "parallel_tool_calls": ask.parallel,
        "previous_response_id": None,
        "reasoning": {"effort": ask.switches.get("reasoning_effort"), "summary": None},
        "store": False,
        "temperature": params.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": _tool_choice(body),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": params.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": {},
    }

    def events(event: GenResponse) -> list[dict[str, Any]]:
        out = [e for item in reader.feed(event) for e in output.add(item)]
        if event.finish_reason is not None:
            out += output.close("incomplete" if event.finish_reason == "length" else "completed")
        return out

    def finished() -> dict[str, Any]:
        final = gen.finals[0]
        stats = final.stats
        reasoning = reader.split.tokens[REASONING]
        complete = final.finish_reason != "length" or bool(reader.calls)
        return {
            **response,
            "status": "completed" if complete else "incomplete",
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "output": _copy(output.items),
            "usage": {
                "input_tokens": stats.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": stats.prompt_tokens - stats.prompt_processed
                },
                "output_tokens": stats.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            },
        }

    if body.stream:
        return EventSourceResponse(
            _stream(gen, response, events, finished),
            sep="\n",
            shutdown_grace_period=SHUTDOWN_GRACE,
        )
    async for _, event in gen.events(request.is_disconnected):
        events(event)
    if not gen.done:
        return Response(status_code=499)
    return JSONResponse(finished())


async def _stream(
    gen: Generation, response: dict, events, finished
) -> AsyncIterator[ServerSentEvent]:
    sequence = 0

    def sse(event: dict[str, Any]) -> ServerSentEvent:
        nonlocal sequence
        event = {**event, "sequence_number": sequence}
        sequence += 1
        return ServerSentEvent(
            json.dumps(event, ensure_ascii=False, separators=(",", ":")), event=event["type"]
        )

    yield sse({"type": "response.created", "response": response})
    yield sse({"type": "response.in_progress", "response": response})
    try:
        async for _, event in gen.events():
            for item in events(event):
                yield sse(item)
        final = finished()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield sse({"type": kind, "response": final})
    except Exception as e:
        error = as_api_error(e)
        gen.metrics.requests.labels(gen.endpoint, str(error.status)).inc()
        body = error.body()["error"]
        yield sse(
            {
                "type": "error",
                "code": body["code"],
                "message": body["message"],
                "param": body["param"],
            }
        )


def _tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return choice.model_dump()
    return choice or "auto"
