"""A model's reasoning told apart from its answer, and the template's switches for it.

Reasoning models think before they answer, between a pair of marker tokens: `<think>` and
`</think>` for Qwen3, DeepSeek-R1 and its distills (whose templates may open the `<think>`
in the prompt themselves). The markers are found in the tokenizer's vocabulary, never in a
list of model names; a model without them has no reasoning to split. Splitting works on
token ids, so a marker is recognised however the text around it is cut into pieces.

The switches are the variables a chat template reads: `enable_thinking` (Qwen3, SmolLM3)
turns thinking on or off, `reasoning_effort` (gpt-oss) sets its depth. A switch the template
does not read is refused rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

REASONING, ANSWER = "reasoning", "answer"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EFFORTS = ("low", "medium", "high")


class _Vocab(Protocol):
    def token_id(self, text: str) -> int | None: ...


@dataclass(frozen=True)
class Markers:
    """The tokens that open and close a model's reasoning."""

    open_id: int
    close_id: int
    open_text: str = THINK_OPEN
    close_text: str = THINK_CLOSE

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt leaves reasoning open (a template that writes `<think>` itself)."""
        return prompt.rfind(self.open_text) > prompt.rfind(self.close_text)


def find_markers(tokenizer: _Vocab) -> Markers | None:
    """The model's reasoning markers, if its vocabulary has both as single tokens."""
    open_id, close_id = tokenizer.token_id(THINK_OPEN), tokenizer.token_id(THINK_CLOSE)
    if open_id is None or close_id is None:
        return None
    return Markers(open_id, close_id)


class Piece(str):
    """A piece of generated text that knows the part it belongs to (REASONING or ANSWER),
    so code that only joins text keeps working."""

    kind: str

    def __new__(cls, kind: str, text: str) -> Piece:
        piece = super().__new__(cls, text)
        piece.kind = kind
        return piece


class Splitter:
    """Reads generated tokens with their text and tells reasoning from answer.

    Marker tokens count as reasoning and print nothing. The reasoning is trimmed of the
    whitespace models put around it (so whitespace inside it is held back until the next
    printable text), and so is the start of an answer that follows reasoning; an answer
    without reasoning passes exactly as generated.
    """

    def __init__(self, markers: Markers | None, prompt: str = "") -> None:
        self.markers = markers
        self.kind = REASONING if markers and markers.opened_by(prompt) else ANSWER
        self.tokens = {REASONING: 0, ANSWER: 0}
        self.text = {REASONING: "", ANSWER: ""}
        self._pending = ""

    def feed(self, token: int | None, text: str) -> list[Piece]:
        """The printable pieces for one generated token (`text` is its decoded text)."""
        markers = self.markers
        if markers is not None and token in (markers.open_id, markers.close_id):
            marker = markers.open_text if token == markers.open_id else markers.close_text
            before = self._emit(text.replace(marker, "", 1))
            self.tokens[REASONING] += 1
            self._pending = ""
            self.kind = REASONING if token == markers.open_id else ANSWER
            return before
        if token is not None:
            self.tokens[self.kind] += 1
        return self._emit(text)

    def _emit(self, text: str) -> list[Piece]:
        if self.kind == ANSWER:
            if not self.text[ANSWER] and self.tokens[REASONING]:
                text = text.lstrip()
            self.text[ANSWER] += text
            return [Piece(ANSWER, text)] if text else []
        stripped = text.rstrip()
        if not stripped:
            self._pending += text
            return []
        out = self._pending + stripped if self.text[REASONING] else stripped.lstrip()
        self._pending = text[len(stripped) :]
        self.text[REASONING] += out
        return [Piece(REASONING, out)] if out else []


def template_switches(
    variables: set[str], think: bool | None, effort: str | None, kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """Template variables for `--think/--no-think` and `--reasoning-effort`, checked against
    the variables the template reads; `kwargs` (a request's chat_template_kwargs) pass as is."""
    from llmrun.errors import UsageError

    switches = dict(kwargs or {})
    if think is not None:
        if "enable_thinking" not in variables:
            raise UsageError(
                "this model's chat template has no switch for thinking (it does not read "
                "enable_thinking): drop --think/--no-think"
            )
        switches["enable_thinking"] = think
    if effort is not None:
        if effort not in EFFORTS:
            raise UsageError(
                f"reasoning effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
            )
        if "reasoning_effort" not in variables:
            raise UsageError(
                "this model's chat template has no reasoning effort (it does not read "
                "reasoning_effort): drop --reasoning-effort"
            )
        switches["reasoning_effort"] = effort
    return switches
