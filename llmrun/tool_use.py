"""Tools offered to a model: a conversation's calls and results rendered as its chat
template expects them (prepare_history), and `llmrun chat --tools` (a tools file loaded
and offered). Parsing the model's calls is tool_calls.py's job."""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable
from typing import Any

from llmrun.reasoning import ANSWER, REASONING, Piece
from llmrun.tool_calls import (
    FORMATS,
    KIMI,
    MISTRAL,
    NAME_PATTERN,
    PHI4,
    Item,
    ToolCall,
    ToolCallParser,
    ToolFormat,
    detect_format,
    dumps,
    kimi_id,
)

# --- rendering a conversation with calls ----------------------------------------------


def mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates insist on (9 letters or digits), the same for
    the same id, so an assistant's call and the tool's answer still match."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    alphabet = string.ascii_letters + string.digits
    return "".join(alphabet[b % len(alphabet)] for b in digest[:9])


def prepare_history(
    messages: list[dict[str, Any]],
    fmt: ToolFormat | None,
    template_source: str,
    tools: list[dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    """Messages as the template expects them: a call's arguments as a dict (transformers'
    convention; OpenAI sends a JSON string), a tool message named after its call, Mistral's
    9-character ids and Kimi K2's `functions.NAME:IDX` ones (which its template writes back
    with the result), calls written into the content where the template cannot render
    `tool_calls`, and Phi-4-mini's tools in its system message."""
    renders_calls = "tool_calls" in template_source
    names: dict[str, str] = {}
    kimi_ids: dict[str, str] = {}  # a call's id as given -> as Kimi's template needs it
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            prepared = []
            for index, call in enumerate(calls):
                function = dict(call["function"])
                try:
                    args = json.loads(function.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = function.get("arguments")
                if isinstance(args, dict):
                    function["arguments"] = args
                call_id = call.get("id") or ""
                names[call_id] = function["name"]
                if fmt is not None and fmt.name == MISTRAL:
                    call_id = mistral_id(call_id)
                if fmt is not None and fmt.name == KIMI:
                    kimi_ids[call_id] = kimi_id(call_id, function["name"], index)
                    call_id = kimi_ids[call_id]
                # DeepSeek-R1's template writes the call's type
                prepared.append({"type": "function", **call, "id": call_id, "function": function})
            message["tool_calls"] = prepared
            if not renders_calls and fmt is not None:
                text = fmt.call_text(prepared)
                message["content"] = f"{message.get('content') or ''}{text}"
                del message["tool_calls"]
        elif message.get("role") == "tool":
            call_id = message.get("tool_call_id") or ""
            if call_id in names and not message.get("name"):
                message["name"] = names[call_id]
            if fmt is not None and fmt.name == MISTRAL:
                message["tool_call_id"] = mistral_id(call_id)
            if call_id in kimi_ids:
                message["tool_call_id"] = kimi_ids[call_id]
            if fmt is not None and fmt.name == PHI4 and not renders_calls:
                message["role"] = "tool_response"  # <|tool|> opens Phi-4-mini's tool list
        out.append(message)
    if tools and fmt is not None and fmt.name == PHI4 and "message['tools']" in template_source:
        functions = dumps([t["function"] for t in tools])
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "tools": functions}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": functions})
    return out


# --- `llmrun chat --tools` -----------------------------------------------------------


def load_tools(path: str) -> list[dict[str, Any]]:
    """`chat --tools FILE`: a JSON list of tools, each OpenAI's {"type": "function",
    "function": {...}} or the function alone, as templates take them."""
    from llmrun.errors import UsageError
    from llmrun.structured import check_schema

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--tools {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--tools {path}: not JSON ({e})") from None
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise UsageError(f"--tools {path}: expected a JSON list of tools")
    tools, names = [], set()
    for i, item in enumerate(data):
        function = item.get("function", item) if isinstance(item, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not NAME_PATTERN.match(name) or name in names:
            raise UsageError(
                f"--tools {path}: tool {i} needs a name of its own (letters, digits, _ and -)"
            )
        names.add(name)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        problem = check_schema(parameters)
        if problem:
            raise UsageError(
                f"--tools {path}: {name}'s parameters are not a JSON schema: {problem}"
            )
        tool = {"name": name, "parameters": parameters}
        if function.get("description"):
            tool["description"] = function["description"]
        tools.append({"type": "function", "function": tool})
    return tools


def engine_format(engine: Any) -> ToolFormat | None:
    """The tool-call format of an api.Engine's template for conversations with tools."""
    template = engine.tools_template
    return detect_format(template.source) if template is not None else None


def offer_tools(session: Any, tools: list[dict[str, Any]]) -> None:
    """`chat --tools`: `session` (a ChatSession) renders `tools` through the template, and
    its replies show each call the model makes as a line `-> name(arguments)`; llmrun does
    not run them. The conversation keeps the calls as the model wrote them."""
    from dataclasses import replace

    from llmrun.errors import UsageError

    engine = session.engine
    fmt = engine_format(engine)
    if fmt is None:
        raise UsageError(
            f"--tools: llmrun knows no tool-call format in {engine.name}'s chat template "
            f"(it reads {', '.join(FORMATS)})"
        )
    fmt = fmt.for_tools(tools)
    session.switches = {**session.switches, "tools": tools}
    markers = fmt.marker_ids(engine.tokenizer)
    generate = engine.generate

    def generate_with_markers(*args: Any, **kwargs: Any) -> Any:
        for response in generate(*args, **kwargs):
            if response.token in markers:  # a special token the detokenizer skipped
                response = replace(response, text=response.text + markers[response.token])
            yield response

    def showing_calls(reply: Callable[..., Any]) -> Callable[..., Any]:
        def shown(*args: Any, **kwargs: Any) -> Any:
            parser, started = ToolCallParser(fmt), False

            def show(item: Item) -> str:
                nonlocal started
                if isinstance(item, ToolCall):
                    line = f"-> {item.name}({item.arguments})"
                    item = Piece(ANSWER, f"\n{line}" if started else line)
                started = started or bool(item)
                return item

            for piece in reply(*args, **kwargs):
                if getattr(piece, "kind", ANSWER) == REASONING:
                    yield piece
                    continue
                yield from (show(item) for item in parser.feed(piece))
            yield from (show(item) for item in parser.finish())

        return shown

    engine.generate = generate_with_markers
    session.send, session.retry = showing_calls(session.send), showing_calls(session.retry)
