"""Which stop string ended a reply. The scheduler cuts the text before the stop string and
finishes with "stop", as after an end-of-generation token; Anthropic's `stop_sequence` and
llama.cpp's `stopping_word` name the string, so this decodes the reply's tokens once more,
uncut, and reads what follows the text that was sent."""

from __future__ import annotations

from collections.abc import Sequence

from llmrun.generate import Response as GenResponse


class StopWatch:
    """Fed a sequence's events, says at its end which of `stop` ended it (None: none did)."""

    def __init__(self, tokenizer, prompt: Sequence[int], stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        # Decoding continues from the prompt, as the scheduler's does (a leading space).
        self.decoder = tokenizer.stream(after=prompt) if self.stop else None
        self.raw = ""  # the reply's text, stop string included
        self.sent = 0  # characters of it that the events carried

    def feed(self, event: GenResponse) -> None:
        self.sent += len(event.text)
        if self.decoder is not None and event.token is not None:
            self.raw += self.decoder.add(event.token)

    def word(self) -> str | None:
        """The stop string right after the text sent (call once, after the last event)."""
        if self.decoder is None:
            return None
        raw = self.raw + self.decoder.flush()
        return next((s for s in self.stop if raw.startswith(s, self.sent)), None)
