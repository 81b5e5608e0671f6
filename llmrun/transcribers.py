"""The speech recognition families that llmrun decodes outside its generation loop (the
encoder-decoders: their model class says `transcribes`), one entry each by config.json
model_type: how a loaded model transcribes a decoded clip. Engine.transcribe dispatches
through it, so `run --audio` and serve's /v1/audio/transcriptions reach every family alike.
TIMESTAMPED holds, for the families that predict times, the transcriber that gives the
transcript's segments with them (Transcription.segments).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from llmrun import (
    audio,
    canary,
    cohere_asr,
    moonshine,
    moonshine_streaming,
    speech_to_text,
    voxtral_realtime,
    whisper,
)
from llmrun.errors import UnsupportedError
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

# (model, tokenizer, folder, generation_config, config, clip, language, task, prompt)
Transcriber = Callable[
    [Any, Tokenizer, Path, dict, dict, audio.Clip, str | None, str | None, str | None],
    Transcription,
]


def _whisper(
    model: Any,
    tokenizer: Tokenizer,
    folder: Path,
    generation: dict[str, Any],
    config: dict[str, Any],
    clip: audio.Clip,
    language: str | None,
    task: str | None,
    prompt: str | None,
    timestamps: bool = False,
    num_beams: int | None = None,
) -> Transcription:
    settings = whisper.Settings.of(generation, config)
    return whisper.transcribe(
        model, tokenizer, settings, clip, language, task, prompt, timestamps, num_beams
    )


FAMILIES: dict[str, tuple[str, Transcriber]] = {
    "whisper": ("Whisper", _whisper),
    "cohere_asr": (cohere_asr.FAMILY, cohere_asr.transcribe),
    "moonshine": (moonshine.FAMILY, moonshine.transcribe),
    "canary": (canary.FAMILY, canary.transcribe),
    "moonshine_streaming": (moonshine_streaming.FAMILY, moonshine_streaming.transcribe),
    "speech_to_text": (speech_to_text.FAMILY, speech_to_text.transcribe),
    "voxtral_realtime": (voxtral_realtime.FAMILY, voxtral_realtime.transcribe),
}


TIMESTAMPED: dict[str, Transcriber] = {"whisper": partial(_whisper, timestamps=True)}

# The families whose transcribers take num_beams: a beam search's, over the folder's.
BEAMED = frozenset(
    {"whisper", "cohere_asr", "moonshine", "canary", "moonshine_streaming", "speech_to_text"}
)

# The families that translate a clip only in a language given (they do not detect it):
# serve's /v1/audio/translations takes it as `language`.
TRANSLATE_FROM_LANGUAGE = frozenset({canary.FAMILY})


def family(model_type: str) -> tuple[str, Transcriber]:
    """The family's name and its transcriber."""
    if model_type not in FAMILIES:
        raise UnsupportedError(f"{model_type!r} is not a speech recognition family llmrun runs")
    return FAMILIES[model_type]
