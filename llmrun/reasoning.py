"""A model's reasoning told apart from its answer, and the template's switches for it.

Reasoning models think before they answer, between a pair of marker tokens: `<think>` and
`</think>` for Qwen3, DeepSeek-R1 and its distills (whose templates may open the `<think>`
in the prompt themselves). gpt-oss writes harmony messages instead,
`<|start|>assistant<|channel|>NAME<|message|>...<|end|>`: the `analysis` channel is its
reasoning, `final` its answer, and `commentary` its tool calls (a header with
`to=functions.NAME`) and their preambles, kept as a kind of its own (COMMENTARY) whose
pieces are the messages as written, header and markers included as fed, so a tool-call
parser can read them. Muse Glimmer writes messages of the same shape without channels,
`<|start|>assistant to=RECIPIENT<|message|>...` ended by `<|eom|>` (more follow) or `<|eot|>`
(the turn's end): `to=self` is its reasoning, `to=user` its answer, any other recipient a
tool's call (as llama.cpp's common/parsers/muse-glimmer.cpp reads them). The markers are
found in the tokenizer's vocabulary, never in a list of model names; a model without them
has no reasoning to split. Splitting works on token ids, so a marker is recognised however
the text around it is cut into pieces.

The switches are the variables a chat template reads: `enable_thinking` (Qwen3, SmolLM3)
turns thinking on or off, `reasoning_effort` (gpt-oss; Muse Glimmer's `reasoning_strength`,
which llama.cpp sets to the same value) sets its depth. A switch the template does not read
is refused rather than silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

REASONING, ANSWER, COMMENTARY = "reasoning", "answer", "commentary"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Reasoning markers, most models' first: Seed-OSS's and Command A Reasoning / R7B's (as
# llama.cpp's and vLLM's reasoning parsers read them).
THINK_MARKERS = (
    (THINK_OPEN, THINK_CLOSE),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>", "<channel|>"),  # Gemma 4's, `thought` written after the opening
)
# The name a model writes after its opening marker, part of neither reasoning nor answer.
CHANNEL_NAMES = {"<|channel>": "thought"}
# Harmony's message tokens: start, channel, message, end (required), return, call.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# Muse Glimmer's: start, message, end of a message that more follow, end of the turn.
MUSE_TOKENS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
EFFORTS = ("low", "medium", "high")
# The template variables of a reasoning effort: gpt-oss's, and Muse Glimmer's, which
# llama.cpp sets to the effort too.
EFFORT_VARIABLES = ("reasoning_effort", "reasoning_strength")


class _Vocab(Protocol):
    def token_id(self, text: str) -> int | None: ...


@dataclass(frozen=True)
class Markers:
    """The tokens that open and close a model's reasoning."""

    open_id: int
    close_id: int
    open_text: str = THINK_OPEN
    close_text: str = THINK_CLOSE
    name: str = ""  # written after the opening (Gemma 4's `thought`)

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt leaves reasoning open: it ends with `<think>` (and maybe
        white space), as a template that writes it for the model does (DeepSeek-R1's).
        One elsewhere in the prompt (a user asking what the tag does) opens nothing, as
        llama.cpp and vLLM read it."""
        end = prompt.rstrip()
        return (
            end.endswith(self.open_text)
            or bool(self.name)
            and end.endswith(self.open_text + self.name)
        )


@dataclass(frozen=True)
class Harmony:
    """The token ids of harmony's message structure (gpt-oss): <|start|>, <|channel|>,
    <|message|>, <|end|>, and <|return|> and <|call|> where the vocabulary has them; or of
    Muse Glimmer's (no <|channel|>; <|eom|> and <|eot|> as `end` and `return_`), whose
    `end_texts` are its own."""

    start: int
    channel: int | None
    message: int
    end: int
    return_: int | None = None
    call: int | None = None
    end_texts: tuple[str, ...] = HARMONY_TOKENS[3:]  # the end markers' texts

    @property
    def ends(self) -> tuple[int | None, ...]:
        """The tokens that end a message."""
        return (self.end, self.return_, self.call)


def find_markers(tokenizer: _Vocab) -> Markers | Harmony | None:
    """The model's reasoning markers: harmony's message tokens if its vocabulary has the
    four it needs (a structure no <think> model's vocabulary has), else Muse Glimmer's if it
    has all of them, else the first pair of THINK_MARKERS it has both of as single tokens."""
    ids = [tokenizer.token_id(t) for t in HARMONY_TOKENS]
    if None not in ids[:4]:
        return Harmony(*ids)
    muse = [tokenizer.token_id(t) for t in MUSE_TOKENS]
    if None not in muse:
        start, message, eom, eot = muse
        return Harmony(start, None, message, eom, eot, end_texts=MUSE_TOKENS[2:])
    for open_text, close_text in THINK_MARKERS:
        open_id, close_id = tokenizer.token_id(open_text), tokenizer.token_id(close_text)
        if open_id is not None and close_id is not None:
            return Markers(
                open_id, close_id, open_text, close_text, CHANNEL_NAMES.get(open_text, "")
            )
    return None


class Piece(str):
    """A piece of generated text that knows the part it belongs to (REASONING, ANSWER or,
    for harmony, COMMENTARY), so code that only joins text keeps working."""

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

    With Harmony markers it reads harmony messages: headers (up to <|message|>) print
    nothing, an `analysis` message (or one `to=self`, Muse Glimmer's) is reasoning, `final`
    (or any other channel, or `to=user`) the answer, and a `commentary` message or one with
    another recipient (` to=`) COMMENTARY, passed as fed from its <|start|> (where the
    prompt opened its header: from what the model wrote of it) to its end marker. Each
    token counts towards the kind of the message it belongs to, its header and end marker
    included; text outside any message passes as answer.
    """

    def __init__(self, markers: Markers | Harmony | None, prompt: str = "") -> None:
        self.markers = markers
        self.tokens = {REASONING: 0, ANSWER: 0}
        self.text = {REASONING: "", ANSWER: ""}
        self._pending = ""
        self._name = ""  # what is left to drop of the name after an opening marker
        self.kind = ANSWER
        if isinstance(markers, Harmony):
            self.tokens[COMMENTARY], self.text[COMMENTARY] = 0, ""
            self._harmony_from(prompt)
        elif markers is not None and markers.opened_by(prompt):
            self.kind = REASONING
            self._name = "" if prompt.rstrip().endswith(markers.name) else markers.name

    def feed(self, token: int | None, text: str) -> list[Piece]:
        """The printable pieces for one generated token (`text` is its decoded text)."""
        markers = self.markers
        if isinstance(markers, Harmony):
            return self._harmony(markers, token, text)
        if markers is not None and token in (markers.open_id, markers.close_id):
            marker = markers.open_text if token == markers.open_id else markers.close_text
            before = self._emit(text.replace(marker, "", 1))
            self.tokens[REASONING] += 1
            self._pending = ""
            self.kind = REASONING if token == markers.open_id else ANSWER
            self._name = markers.name if token == markers.open_id else ""
            return before
        if token is not None:
            self.tokens[self.kind] += 1
        if self._name:
            text = self._drop_name(text)
        return self._emit(text)

    def _drop_name(self, text: str) -> str:
        """The text without what it holds of the name after the opening marker."""
        if text.startswith(self._name):
            text, self._name = text[len(self._name) :], ""
        elif self._name.startswith(text):
            text, self._name = "", self._name[len(text) :]
        else:  # the model named no channel
            self._name = ""
        return text

    # ---- harmony ------------------------------------------------------------------------

    def _harmony_from(self, prompt: str) -> None:
        """Where the prompt leaves the reply: in a header (a template that ends with
        `<|start|>assistant`), in a message's body (one that also opens the channel), or
        outside any message."""
        self.header: str | None = None  # the open header's generated text, None outside one
        # The open header as classified: the prompt's part, then the generated one with
        # <|channel|> written out (the text fed for a special token may be empty).
        self._head = ""
        self._counted = 0  # the open header's tokens, counted once its kind is known
        self._open = False  # whether a message's body is open
        start = prompt.rfind("<|start|>")
        ends = max(prompt.rfind(t) for t in self.markers.end_texts)
        if start < 0 or ends > start:
            return
        head, found, _ = prompt[start:].partition("<|message|>")
        if found:
            self._open_body(head)
        else:
            self._head, self.header = head, ""

    def _open_body(self, header: str) -> None:
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        to = recipient.group(1) if recipient else ""
        if (to and to not in ("self", "user")) or name == "commentary":
            self.kind = COMMENTARY
        elif name == "analysis" or to == "self":
            self.kind = REASONING
            if self.text[REASONING]:
                self._pending = "\n"  # messages of reasoning apart by a line
        else:
            self.kind = ANSWER
        self.header, self._head, self._open = None, "", True

    def _harmony(self, m: Harmony, token: int | None, text: str) -> list[Piece]:
        counted = token is not None
        channel = counted and token == m.channel
        if token == m.start or (channel and self.header is None and not self._open):
            # A new message (one still open ends here, as if closed).
            self._close()
            self.header, self._head, self._counted = "", "", 0
        if self.header is not None:  # in a header: nothing prints until <|message|>
            self.header += text
            self._head += "<|channel|>" if channel else "" if token == m.start else text
            self._counted += counted
            if not _could_be_header(self._head):
                # Not a message header after all (a model that ignores the format): its
                # text is the answer, as text outside any message is, so nothing is lost.
                written, self.header, self._head = self.header, None, ""
                self.kind = ANSWER
                self.tokens[ANSWER] += self._counted
                return self._emit(written)
            if token != m.message:
                return []
            header = self.header
            self._open_body(self._head)
            self.tokens[self.kind] += self._counted
            return self._commentary(header) if self.kind == COMMENTARY else []
        self.tokens[self.kind] += counted
        if counted and token in m.ends:
            out = self._commentary(text) if self.kind == COMMENTARY else []
            self._close()
            return out
        return self._commentary(text) if self.kind == COMMENTARY else self._emit(text)

    def _close(self) -> None:
        """End the open message: what follows outside any message is answer."""
        self._open, self._pending, self.kind = False, "", ANSWER

    def _commentary(self, text: str) -> list[Piece]:
        self.text[COMMENTARY] += text
        return [Piece(COMMENTARY, text)] if text else []

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


# What may follow <|start|> in a message the model writes: its role, then a channel, a
# recipient, a constraint or the body's <|message|> (harmony's and Muse Glimmer's headers).
_ROLE = "assistant"
_AFTER_ROLE = ("<|channel|>", " to=", "<|constrain|>", "<|message|>")


def _could_be_header(head: str) -> bool:
    """Whether `head` (a header's text so far, <|start|> and all) begins as a header can:
    the role, or no role (a header opened by <|channel|>), then what may follow it."""
    head = head.removeprefix("<|start|>")
    if _ROLE.startswith(head):
        return True
    rest = head.removeprefix(_ROLE)
    return any(rest.startswith(o) or o.startswith(rest) for o in _AFTER_ROLE)


def template_switches(
    variables: set[str], think: bool | None, effort: str | None, kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """Template variables for `--think/--no-think` and `--reasoning-effort`, checked against
    the variables the template reads; `kwargs` (a request's chat_template_kwargs) pass as is."""
    from llmrun.errors import UsageError

    switches = dict(kwargs or {})
    if think is not None:
        # Qwen3's, SmolLM3's name for it; Granite 3.3's and DeepSeek V3.1's `thinking`.
        name = next((v for v in ("enable_thinking", "thinking") if v in variables), None)
        if name is None:
            raise UsageError(
                "this model's chat template has no switch for thinking (it reads neither "
                "enable_thinking nor thinking): drop --think/--no-think"
            )
        switches[name] = think
    if effort is not None:
        if effort not in EFFORTS:
            raise UsageError(
                f"reasoning effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
            )
        name = next((v for v in EFFORT_VARIABLES if v in variables), None)
        if name is None:
            raise UsageError(
                "this model's chat template has no reasoning effort (it does not read "
                "reasoning_effort): drop --reasoning-effort"
            )
        switches[name] = effort
    return switches
