"""The speech recognition families that llmrun decodes outside its generation loop (the
encoder-decoders: their model class says `transcribes`), one entry each by config.json
model_type: how a loaded model transcribes a decoded clip. Engine.transcribe dispatches
through it, so `run --audio` and serve's /v1/audio/transcriptions reach every family alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrun import audio, cohere_asr, moonshine, whisper
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
) -> Transcription:
    settings = whisper.Settings.of(generation, config)
    return whisper.transcribe(model, tokenizer, settings, clip, language, task, prompt)


FAMILIES: dict[str, tuple[str, Transcriber]] = {
    "whisper": ("Whisper", _whisper),
    "cohere_asr": (cohere_asr.FAMILY, cohere_asr.transcribe),
    "moonshine": (moonshine.FAMILY, moonshine.transcribe),
}


def family(model_type: str) -> tuple[str, Transcriber]:
    """The family's name and its transcriber."""
    if model_type not in FAMILIES:
        raise UnsupportedError(f"{model_type!r} is not a speech recognition family llmrun runs")
    return FAMILIES[model_type]
