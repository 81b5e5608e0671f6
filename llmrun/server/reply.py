"""A chat reply, from the conversation to what the model said, for both chat endpoints.

`prepare` renders the conversation (history with tool calls and results as the template
expects, tools passed to the template as transformers passes them), encodes it, and
compiles the grammar the request imposes: a call that `tool_choice: "required"` or a named
function demands, JSON for a response format, or either for `auto` with a response format.
`ReplyReader` turns the generated tokens into reasoning, content and tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmrun import api
from llmrun.chat_template import plain_transcript
from llmrun.generate import Response as GenResponse
from llmrun.multimodal import PromptImages
from llmrun.reasoning import ANSWER, REASONING, Piece, Splitter
from llmrun.server.schema import ApiError
from llmrun.tool_calls import FORMATS, Item, ToolCall, ToolCallParser, ToolFormat
from llmrun.tool_use import prepare_history


@dataclass
class Ask:
    """What a request asks of the model, in the endpoint-neutral form `prepare` takes."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # as templates take them
    tool_choice: str = "auto"  # none, auto, required, or a function's name
    parallel: bool = True
    schema: dict[str, Any] | None = None  # JSON output: {} for any object, else a schema
    schema_param: str = "response_format"
    switches: dict[str, Any] = field(default_factory=dict)
    # The soft-token embeddings of the messages' image parts, in order (server.images)
    images: list[Any] = field(default_factory=list)
    # The token embeddings of the messages' audio parts, in order (server.audio)
    audio: list[Any] = field(default_factory=list)


@dataclass
class Prepared:
    text: str
    ids: list[int]
    fmt: ToolFormat | None  # the format to read calls in (None: no tools to call)
    grammar: Any = None  # a structured.Grammar, or None
    forced: bool = False  # tool_choice "required" or a named function: the reply is calls
    # Where the conversation ends in ids, before the generation prompt (api.Engine.
    # history_end), for a hybrid model, which keeps its state there; else None.
    history_end: int | None = None
    images: PromptImages | None = None  # where the images go in ids

    def stops(self, stop: list[str]) -> list[str]:
        """The stop strings to apply: none to a forced call, whose text they would cut
        into markup that is no call (and which its grammar ends anyway)."""
        return [] if self.forced else stop


def tool_format(engine: api.Engine) -> ToolFormat | None:
    from llmrun.tool_use import engine_format

    return engine_format(engine)


def prepare(engine: api.Engine, fmt: ToolFormat | None, ask: Ask) -> Prepared:
    """The prompt and grammar for `ask` (slow for a long conversation: run it off the loop)."""
    if engine.image_to_text and ask.images:
        return _image_to_text(engine, ask)
    if engine.text_to_text and engine.template is None:  # T5Gemma's -it models have one
        raise ApiError(
            400,
            f"{engine.name} is a text-to-text model (encoder-decoder), which has no chat template: send "
            "its prompt to /v1/completions",
            param="messages",
        )
    plain = engine.template is None
    calling = bool(ask.tools) and ask.tool_choice != "none"
    if calling and plain:  # tool_choice "none": the tools are left out, as the choice says
        raise ApiError(
            400, "this model has no chat template, so it cannot take tools", param="tools"
        )
    if calling and fmt is None:
        raise ApiError(
            400,
            "llmrun knows no tool-call format in this model's chat template (it reads "
            f"{', '.join(FORMATS)}): it cannot call tools",
            param="tools",
        )
    if plain:
        text = plain_transcript(ask.messages)
    else:
        source = (engine.tools_template if ask.tools else engine.template).source
        messages = prepare_history(ask.messages, fmt, source, ask.tools)
        switches = dict(ask.switches)
        if ask.tools:
            switches["tools"] = ask.tools
        text = engine.render(messages, **switches)
    images = None
    if ask.images or ask.audio:
        ids, images = engine.encoded_media_prompt(text, ask.images, ask.audio)
    else:
        ids = engine.tokenizer.encode(text)
    history_end = None
    if not plain and hasattr(engine.model.args, "recurrent_shapes"):
        history_end = engine.history_end(messages, ids, **switches)
    fmt = fmt.for_tools(ask.tools) if calling and fmt is not None else None
    forced = fmt is not None and ask.tool_choice != "auto"
    from llmrun.structured import for_prompt

    grammar = _grammar(engine, fmt, ask, forced)
    grammar = for_prompt(grammar, engine.markers, text, answer=fmt is None)
    return Prepared(text, ids, fmt, grammar, forced, history_end, images)


def _image_to_text(engine: api.Engine, ask: Ask) -> Prepared:
    """An image-to-text encoder-decoder's prompt (Florence-2's, TrOCR's): one user message,
    its image and its text (a task prompt, or none), framed by the model's processor."""
    message = ask.messages[0]
    if len(ask.messages) != 1 or message["role"] != "user":
        raise ApiError(
            400,
            f"{engine.name} is an image-to-text model: send one user message, its image and "
            "its prompt",
            param="messages",
        )
    if ask.tools or ask.schema is not None:
        raise ApiError(400, f"{engine.name} is an image-to-text model: no tools or response format")
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "".join(block["text"] for block in content if "text" in block)
    ids, images = engine.encoded_media_prompt(content, ask.images, ask.audio)
    return Prepared(content, ids, None, images=images)


def _grammar(engine: api.Engine, fmt: ToolFormat | None, ask: Ask, forced: bool) -> Any:
    """The grammar of a response format or of forced calls, from the reply's first token."""
    if not forced and ask.schema is None:
        return None
    from llmrun import structured

    vocab = structured.vocabulary(engine.tokenizer, engine.eos_ids)
    param = ask.schema_param if not forced else "tools"
    tools = [
        {**t, "function": {**t["function"], "parameters": structured.closed_objects(params)}}
        if (params := t["function"].get("parameters"))
        else t
        for t in ask.tools or ()
    ]
    try:
        if not forced and fmt is None:
            return vocab.json_schema(ask.schema or None, param)
        if not forced:  # auto with a response format: a call, or the JSON answer
            calls = fmt.grammar(tools, vocab.token, ask.parallel)
            answer = fmt.answer(structured.json_lark(ask.schema or None, param), vocab.token)
            text = f"start: calls | answer\nanswer: {answer}\n" + calls.replace(
                "start:", "calls:", 1
            )
            return vocab.lark(text, param)
        if ask.tool_choice != "required":
            tools = [t for t in tools if t["function"]["name"] == ask.tool_choice]
        return vocab.lark(fmt.grammar(tools, vocab.token, ask.parallel), "the tools' parameters")
    except structured.GrammarError as e:
        raise ApiError(400, str(e), param=param) from None


class ReplyReader:
    """One reply's generated events -> items: reasoning and answer Pieces, ToolCalls."""

    def __init__(self, engine: api.Engine, prepared: Prepared) -> None:
        self.plain = engine.template is None
        self.split = Splitter(None if self.plain else engine.markers, prepared.text)
        fmt = prepared.fmt
        self.parser = ToolCallParser(fmt) if fmt is not None else None
        self.marker_ids = fmt.marker_ids(engine.tokenizer) if fmt is not None else {}
        self._started = False  # whether a plain transcript's reply has begun
        self._content = ""  # the content, where no parser reads it

    def feed(self, event: GenResponse) -> list[Item]:
        text = event.text
        if event.token in self.marker_ids:  # a special token the detokenizer skipped
            text += self.marker_ids[event.token]
        if self.plain and not self._started:
            text = text.lstrip()  # the reply to "Assistant:" begins with a space
            self._started = bool(text)
        out: list[Item] = []
        for piece in self.split.feed(event.token, text):
            if piece.kind == REASONING:
                out.append(piece)
            elif self.parser is not None:
                out.extend(self.parser.feed(piece))
            elif piece.kind == ANSWER:
                self._content += piece
                out.append(piece)
            # else harmony's commentary (a call, as written, with its header) where no
            # tools are called (tool_choice "none"): not the answer, and not for the user
        if event.finish_reason is not None and self.parser is not None:
            out.extend(self.parser.finish())
        return out

    @property
    def content(self) -> str:
        return self.parser.content if self.parser is not None else self._content

    @property
    def reasoning(self) -> str:
        extra = self.parser.reasoning if self.parser is not None else ""
        return self.split.text[REASONING] + extra

    @property
    def has_reasoning(self) -> bool:
        """Whether the model can reason apart (markers, or harmony's analysis channel)."""
        return self.split.markers is not None or bool(self.reasoning)

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def finish_reason(self, final: str | None) -> str | None:
        return "tool_calls" if self.calls and final == "stop" else final


def is_reasoning(item: Item) -> bool:
    return isinstance(item, Piece) and item.kind == REASONING
