"""A chat session: history, the model's template, and a KV cache kept across turns.

Each turn renders the whole conversation and generates after it; the cache
keeps the prefix shared with the previous turn, so only the new tokens are
prefilled. No input or output happens here (see repl.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmrun.api import Engine
from llmrun.chat_template import plain_transcript
from llmrun.errors import ContextOverflowError, LlmrunError, UsageError
from llmrun.generate import KVState, Response
from llmrun.multimodal import PromptImages
from llmrun.reasoning import ANSWER, REASONING, Splitter
from llmrun.sampling import SamplingParams

# /set PARAM VALUE: the settable parameters and their types.
SETTABLE = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "seed": int,
    "max_tokens": int,
}
PLAIN_STOP = "\nUser:"
WARN_FRACTION = 0.9


@dataclass
class Turn:
    """What one reply did, for the caller to report."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    interrupted: bool = False
    response: Response | None = None
    dropped: int = 0  # messages removed by --context-overflow shift
    withdrawn: bool = False  # stopped before its first token: the message is not kept


@dataclass
class ChatSession:
    engine: Engine
    params: SamplingParams
    max_tokens: int | None = None
    system: str | None = None
    overflow: str = "error"  # or "shift": drop the oldest turns to make room
    messages: list[dict[str, Any]] = field(default_factory=list)
    state: KVState | None = None
    switches: dict[str, Any] = field(default_factory=dict)  # template variables (thinking)
    # The image and audio parts attached for the next user message (attach, attach_audio),
    # in the order attached, each holding its embeddings
    pending: list[dict[str, Any]] = field(default_factory=list)
    # Whether the cached tokens ran with the audio's own adapter (Engine.audio_lora)
    audio_adapted: bool = False

    def __post_init__(self) -> None:
        if self.overflow not in ("error", "shift"):
            raise UsageError(f"--context-overflow must be error or shift, got {self.overflow!r}")
        if self.state is None:
            self.state = self.engine.new_state()

    @property
    def uses_template(self) -> bool:
        return self.engine.template is not None

    @property
    def context_size(self) -> int:
        return self.state.capacity

    @property
    def context_used(self) -> int:
        """The tokens the conversation holds now, which the next turn starts from (after
        /undo or /load, not what the cache last held)."""
        if not self.messages:
            return 0
        try:
            return len(self.prompt_ids(self.conversation()))
        except LlmrunError:  # a template that refuses this history as it stands
            return len(self.state.tokens)

    def conversation(self, messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The system message, then `messages` (default: the whole history)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + (self.messages if messages is None else messages)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._encode(self.prompt_text(messages), messages)[0]

    def _encode(
        self, text: str, messages: list[dict[str, Any]]
    ) -> tuple[list[int], PromptImages | None]:
        """The ids of `messages` rendered as `text`, and their images or audio clips (each
        such part holds its embeddings), which every turn feeds the model again."""
        parts = [
            part
            for message in messages
            if isinstance(message["content"], list)
            for part in message["content"]
            if part.get("type") in ("image", "audio")
        ]
        if not parts:
            return self.engine.tokenizer.encode(text), None
        images = [part["embeds"] for part in parts if part["type"] == "image"]
        clips = [part["embeds"] for part in parts if part["type"] == "audio"]
        return self.engine.encoded_media_prompt(text, images, clips)

    def attach(self, images: list[Any]) -> None:
        """Encode decoded images (llmrun.images.open_image) to go with the next user
        message, before its text."""
        if self.engine.speculator is not None:
            raise UsageError("images do not go with --draft or --lookup")
        embeds = self.engine.encode_images(images)
        self.pending.extend({"type": "image", "embeds": e} for e in embeds)

    def attach_audio(self, clips: list[Any]) -> None:
        """Encode decoded audio clips (llmrun.audio.open_audio) to go with the next user
        message, before its text."""
        if self.engine.speculator is not None:
            raise UsageError("audio does not go with --draft or --lookup")
        embeds = self.engine.encode_audio(clips)
        self.pending.extend({"type": "audio", "embeds": e} for e in embeds)

    def prompt_text(self, messages: list[dict[str, Any]]) -> str:
        if self.uses_template:
            return self.engine.render(messages, **self.switches)
        return plain_transcript(messages)

    def send(self, text: str, turn: Turn | None = None) -> Iterator[str]:
        """Add a user message and stream the reply's text. `turn` receives the
        outcome; an interrupted reply (KeyboardInterrupt) is kept as it stands."""
        content: str | list[dict[str, Any]] = text
        if self.pending:
            content = [*self.pending, {"type": "text", "text": text}]
            self.pending = []
        self.messages.append({"role": "user", "content": content})
        return self._reply(turn if turn is not None else Turn())

    def retry(self, turn: Turn | None = None) -> Iterator[str]:
        """Regenerate the last reply."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise UsageError("nothing to retry: there is no reply yet")
        self.messages.pop()
        return self._reply(turn if turn is not None else Turn())

    def undo(self) -> None:
        """Drop the last exchange (the user message and its reply)."""
        if not self.messages:
            raise UsageError("nothing to undo")
        while self.messages and self.messages.pop()["role"] != "user":
            pass

    def clear(self) -> None:
        """Start a new conversation (the system message stays)."""
        self.messages.clear()
        self.pending.clear()
        self.state.tokens.clear()

    def set_param(self, name: str, value: str) -> None:
        if name == "think":
            if value not in ("on", "off"):
                raise UsageError(f"think needs on or off, got {value!r}")
            self.switches = self.engine.switches(think=value == "on", kwargs=self.switches)
            return
        if name not in SETTABLE:
            raise UsageError(f"unknown parameter {name!r} (settable: {', '.join(SETTABLE)})")
        try:
            parsed = SETTABLE[name](value)
        except ValueError:
            kind = "an integer" if SETTABLE[name] is int else "a number"
            raise UsageError(f"{name} needs {kind}, got {value!r}") from None
        # -1 means what it means for --max-tokens and --seed: no limit, a random seed.
        if name == "max_tokens":
            if parsed < -1:
                raise UsageError(f"max_tokens must be >= -1 (-1: no limit), got {parsed}")
            self.max_tokens = None if parsed == -1 else parsed
        elif name == "seed" and parsed == -1:
            self.params = replace(self.params, seed=None)  # updated() ignores None
        else:
            self.params = self.params.updated(**{name: parsed})

    def save(self, path: str | Path) -> None:
        if any(isinstance(m["content"], list) for m in self.messages):
            raise UsageError("/save keeps text only, and this conversation has images or audio")
        data = {"system": self.system, "messages": self.messages}
        try:
            Path(path).expanduser().write_text(
                json.dumps(data, ensure_ascii=False, indent=2) + "\n"
            )
        except OSError as e:
            raise LlmrunError(f"cannot save to {path}: {e.strerror or e}") from None

    def load(self, path: str | Path) -> None:
        try:
            data = json.loads(Path(path).expanduser().read_text())
        except OSError as e:
            raise LlmrunError(f"cannot load {path}: {e.strerror or e}") from None
        except ValueError as e:  # not JSON, or not UTF-8
            raise LlmrunError(f"{path}: not a saved conversation ({e})") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        system = data.get("system") if isinstance(data, dict) else None
        if (
            not isinstance(messages, list)
            or not all(
                isinstance(m, dict)
                and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str)
                for m in messages
            )
            or not isinstance(system, (str, type(None)))
        ):
            raise LlmrunError(
                f"{path}: not a saved conversation (expected messages with role and content, "
                "and a system prompt that is text)"
            )
        self.system = system or self.system
        self.messages = messages

    def _fit(self, turn: Turn) -> tuple[str, list[int], PromptImages | None]:
        """The prompt (text, ids and images) for the conversation, dropping old turns if
        allowed and needed."""
        room = (
            max(self.context_size // 8, 1)
            if self.max_tokens is None
            else min(self.max_tokens, self.context_size // 2)
        )
        dropped: list[dict[str, Any]] = []
        while True:
            try:
                text = self.prompt_text(self.conversation())
                ids, images = self._encode(text, self.conversation())
            except LlmrunError:
                self.messages[:0] = dropped
                # a template (or image places) that refuse the turn: it never happened
                self.messages.pop()
                raise
            if len(ids) + room <= self.context_size:
                turn.dropped = len(dropped)
                return text, ids, images
            if self.overflow != "shift" or len(self.messages) <= 1:
                self.messages[:0] = dropped  # a refused message costs the history nothing
                raise self._overflow(len(ids), room)
            # Drop the oldest exchange; the system message is never dropped.
            dropped.append(self.messages.pop(0))
            while self.messages and self.messages[0]["role"] != "user":
                dropped.append(self.messages.pop(0))

    def _overflow(self, needed: int, room: int) -> ContextOverflowError:
        """Refuse the new message (it is dropped). /clear and shift help only where the
        message fits once the older ones are gone; else it must be shorter."""
        message = self.messages.pop()
        if self.messages:
            alone = len(self.prompt_ids(self.conversation([message])))
            if alone + room <= self.context_size:
                return ContextOverflowError(
                    f"the conversation needs {needed} tokens plus room for a reply, but the "
                    f"context holds {self.context_size}: /clear to start over, or use "
                    "--context-overflow shift (or a larger --ctx-size)"
                )
            needed = alone
        return ContextOverflowError(
            f"the message needs {needed} tokens plus room for a reply, but the context holds "
            f"{self.context_size}: shorten it, or use a larger --ctx-size"
        )

    def _reply(self, turn: Turn) -> Iterator[str]:
        """Stream the reply's pieces (reasoning.Piece: each knows if it is reasoning)."""
        try:
            rendered, prompt, images = self._fit(turn)
        except KeyboardInterrupt:
            self._withdraw(turn)
            raise
        stop = () if self.uses_template else (PLAIN_STOP,)
        split = Splitter(self.engine.markers, rendered)
        completed = False
        history_end = None
        if self.uses_template and self.state.cache.recurrent is not None:
            history_end = self.engine.history_end(self.conversation(), prompt, **self.switches)
        adapted = self.engine.audio_lora and images is not None
        if adapted != self.audio_adapted:  # the cached tokens ran otherwise: none is reused
            self.state.tokens.clear()
            self.audio_adapted = adapted
        try:
            for response in self.engine.generate(
                prompt,
                self.params,
                self.max_tokens,
                stop=stop,
                state=self.state,
                history_end=history_end,
                images=images,
            ):
                turn.response = response
                text = response.text
                if not self.uses_template and not split.text[ANSWER]:
                    text = text.lstrip()  # the reply to "Assistant:" starts with a space
                yield from split.feed(response.token, text)
            turn.finish_reason = turn.response.finish_reason if turn.response else None
            completed = True
        except KeyboardInterrupt:
            turn.interrupted = True
        finally:
            turn.text, turn.reasoning = split.text[ANSWER], split.text[REASONING]
            if turn.response is None and not completed:
                self._withdraw(turn)  # stopped (or failed) before the first token
            else:
                reply = turn.text.rstrip() if not self.uses_template else turn.text
                message = {"role": "assistant", "content": reply}
                if turn.reasoning:
                    message["reasoning_content"] = turn.reasoning  # the template decides
                self.messages.append(message)

    def _withdraw(self, turn: Turn) -> None:
        """Drop the message of a turn stopped before its reply began, or templates that
        want user and assistant turns in alternation would refuse every later one."""
        self.messages.pop()
        turn.withdrawn = True

    @property
    def near_full(self) -> bool:
        return self.context_used >= WARN_FRACTION * self.context_size
