"""What a request to `llmrun serve` may say, and the errors it gets back, in OpenAI's shapes.

The request bodies are pydantic models of the fields of OpenAI's API that llmrun honours
(others are accepted and ignored, as OpenAI-compatible servers do); ApiError is an error in
OpenAI's JSON error shape, and every library error maps to one.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.responses import JSONResponse

from llmrun.errors import ContextOverflowError, LlmrunError, ServerBusyError

RETRY_AFTER_SECONDS = 1


# --- request bodies: the fields of OpenAI's API that llmrun honours --------------------

Probability = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopText = Annotated[str, Field(max_length=512)]
MAX_CHOICES = 16  # a request's `n`
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class LoraScale(BaseModel):
    """A LoRA adapter's scale, by its id (GET /lora-adapters), as llama.cpp's server
    takes it."""

    id: int
    scale: Annotated[float, Field(allow_inf_nan=False)]


class Body(BaseModel):
    """A request body whose fields may be null: OpenAI's fields are nullable, and clients
    send null for "not set", which takes the default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class Sampling(Body):
    """Fields common to both endpoints; top_k, min_p, repeat_penalty, ignore_eos and
    lora (the request's adapter scales) are extensions, as in llama.cpp's and vLLM's
    servers."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    lora: list[LoraScale] | None = None


class TextToTextFields(Body):
    """Extensions for a text-to-text model's completions (llmrun.server.serial.options_of):
    its beams (vLLM's and transformers' name; 1: greedy or sampled) and a many-to-many
    translator's language codes."""

    num_beams: Annotated[int, Field(ge=1)] | None = None
    source_language: Annotated[str, Field(max_length=64)] | None = None
    target_language: Annotated[str, Field(max_length=64)] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str  # a data: URL (llmrun.server.images)
    detail: str | None = None  # OpenAI's resolution hint; Gemma 3 sees every image alike


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    data: str  # base64 (llmrun.server.audio)
    format: str  # "wav" is what serve takes


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str
    arguments: str = ""  # a JSON object's text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call in an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning (DeepSeek's field)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates take it; text parts joined by newlines, or, where
        it has images or audio, its parts in order: {"type": "image", "url": ...} (the
        template's image part, carrying the image's URL: llmrun.server.images), {"type":
        "audio", "data": ..., "format": ...} (llmrun.server.audio) and text parts."""
        content: Any = self.content
        media = (ImagePart, AudioPart)
        if isinstance(content, list) and any(isinstance(p, media) for p in content):
            content = [_template_part(part) for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM and llama.cpp join them
        # Templates know "system"; OpenAI's newer name for it is "developer".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _template_part(part: TextPart | ImagePart | AudioPart) -> dict[str, Any]:
    """A content part as chat templates take it (Message.as_dict)."""
    if isinstance(part, ImagePart):
        return {"type": "image", "url": part.image_url.url}
    if isinstance(part, AudioPart):
        return {"type": "audio", **part.input_audio.model_dump()}
    return {"type": "text", "text": part.text}


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef

    def as_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' JSON-schema form)."""
        function = self.function.model_dump(exclude_none=True, exclude={"strict"})
        function.setdefault("parameters", {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatBody(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    n: Choices = 1
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, param: str = "tools") -> None:
    """Function tools OpenAI would take: valid unique names, parameters that are JSON
    schemas, a tool_choice that names one of them."""
    from llmrun.structured import check_schema
    from llmrun.tool_calls import NAME_PATTERN

    if choice is not None and not tools and choice != "none":
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        name = tool.function.name
        where = f"{param}.{i}"
        if not NAME_PATTERN.match(name):
            raise ApiError(
                400,
                f"{where}.function.name: {name!r} is not a function name (letters, digits, _ "
                "and -, at most 64)",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise ApiError(
                400, f"{where}: two tools are named {name!r}", param=f"{where}.function.name"
            )
        seen.add(name)
        schema = tool.function.parameters
        problem = check_schema(schema) if schema is not None else None
        if not problem and schema is not None and schema.get("type", "object") != "object":
            problem = "a function's parameters must be an object schema"
        if problem:
            raise ApiError(
                400,
                f"{where}.function.parameters is not a JSON schema: {problem}",
                param=f"{where}.function.parameters",
            )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise ApiError(
            400,
            f"tool_choice names {choice.function.name!r}, which is not among the tools",
            param="tool_choice",
        )


def check_history(messages: list[dict[str, Any]], param: str = "messages") -> None:
    """Every tool message answers a call of an earlier assistant message."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            calls.add(call["id"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id is None:
                raise ApiError(
                    400, f"{param}.{i}: a tool message needs a tool_call_id", param=f"{param}.{i}"
                )
            if call_id not in calls:
                raise ApiError(
                    400,
                    f"{param}.{i}: the tool message answers tool_call_id {call_id!r}, but no "
                    "earlier assistant message made that call",
                    param=f"{param}.{i}.tool_call_id",
                )


class CompletionBody(Sampling, TextToTextFields):
    # One prompt (text or token ids) or several, each answered by `n` choices.
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1)]
    )
    n: Choices = 1
    # 0 with echo: only the prompt's logprobs (scoring a text, as lm-eval asks).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt comes first in each choice's text (and logprobs)
    suffix: str | None = None  # the text after the completion: a fill-in-the-middle prompt

    @model_validator(mode="after")
    def _nothing_to_generate_needs_echo(self) -> CompletionBody:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing unless echo is true")
        return self


class EmbeddingBody(Body):
    """OpenAI's embeddings request: `input` one text or token id list, or several; vectors
    as floats or base64 (little-endian float32); `dimensions` only the model's own.
    `embd_normalize` (llama.cpp's): 2 unit length (the default), -1 raw vectors;
    `truncate` (llmrun's): cut an input longer than the context rather than refuse it."""

    model: str | None = None
    input: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    embd_normalize: Literal[-1, 2] = 2
    truncate: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _something_to_embed(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("an empty list: nothing to embed")
        return value


class RerankBody(Body):
    """A rerank request as Jina's, Cohere's and llama.cpp's /rerank take it: a `query`,
    its `documents` (texts, or objects with a text), the `top_n` best to return (default:
    all);
    `return_documents` (Jina's, Cohere's): each result's text too; `truncate` (llmrun's):
    cut a document whose pair with the query passes the context rather than refuse it."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = False
    truncate: bool = False

    @field_validator("documents", mode="before")
    @classmethod
    def _texts_of_objects(cls, value: Any) -> Any:
        """Documents given as {"text": ...} objects (Jina's, Cohere's) as their texts."""
        if not isinstance(value, list):
            return value
        return [d["text"] if isinstance(d, dict) and "text" in d else d for d in value]


class ScoreBody(Body):
    """vLLM's /v1/score request: `text_1` scored against each of `text_2` (a text or
    texts), or texts paired one to one (two lists of one length)."""

    model: str | None = None
    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = False

    @model_validator(mode="after")
    def _pairs(self) -> ScoreBody:
        if isinstance(self.text_1, list) and len(self.text_1) > 1:
            if not isinstance(self.text_2, list) or len(self.text_2) != len(self.text_1):
                raise ValueError(
                    "text_1 of several texts pairs them one to one with text_2: give as many"
                )
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs to score, in order."""
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return list(zip(firsts, seconds, strict=True))


# --- errors ---------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def busy_error(message: str) -> ApiError:
    """503 with Retry-After: every slot is taken and the queue is full."""
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return ApiError(503, message, "server_error", code="server_busy", headers=headers)


def as_api_error(e: Exception, prompt_param: str = "messages") -> ApiError:
    """The OpenAI-shaped error for any exception; an unexpected one is logged as a 500.
    `prompt_param`: the request's field that a prompt too long for the context is about."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ServerBusyError):
        return busy_error(str(e))
    if isinstance(e, ContextOverflowError):
        return ApiError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, LlmrunError):
        return ApiError(400, str(e))
    logging.getLogger("uvicorn.error").exception("request failed")
    return ApiError(500, "internal error while generating", "server_error")


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """pydantic's complaint as one message, and the parameter it is about."""
    errors = e.errors(include_url=False)
    parts = []
    for err in errors[:3]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return "; ".join(parts), param
