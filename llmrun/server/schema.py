"""What a request to `llmrun serve` may say, and the errors it gets back, in OpenAI's shapes.

The request bodies are pydantic models of the fields of OpenAI's API that llmrun honours
(others are accepted and ignored, as OpenAI-compatible servers do); ApiError is an error in
OpenAI's JSON error shape, and every library error maps to one.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse

from llmrun.errors import ContextOverflowError, LlmrunError, ServerBusyError

RETRY_AFTER_SECONDS = 1


# --- request bodies: the fields of OpenAI's API that llmrun honours --------------------

Probability = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopText = Annotated[str, Field(max_length=512)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields common to both endpoints; top_k, min_p, repeat_penalty and
    ignore_eos are extensions, as in llama.cpp's and vLLM's servers."""

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
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning (DeepSeek's field)

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates know "system"; OpenAI's newer name for it is "developer".
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class ChatBody(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(Sampling):
    prompt: str | list[int] | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    suffix: Literal[None, ""] = None


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


def as_api_error(e: Exception) -> ApiError:
    """The OpenAI-shaped error for any exception; an unexpected one is logged as a 500."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ServerBusyError):
        return busy_error(str(e))
    if isinstance(e, ContextOverflowError):
        return ApiError(400, str(e), param="messages", code="context_length_exceeded")
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
