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
    omniasr_ctc,
    parakeet,
    seamless_m4t,
    speech_to_text,
    voxtral_realtime,
    wav2vec2,
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
    words: bool = False,
    temperature: float | None = None,
    seed: int | None = None,
) -> Transcription:
    settings = whisper.Settings.of(generation, config)
    fallback = None if temperature is None else whisper.Fallback.starting_at(temperature)
    return whisper.transcribe(
        model,
        tokenizer,
        settings,
        clip,
        language,
        task,
        prompt,
        timestamps,
        num_beams,
        words,
        fallback,
        seed,
    )


FAMILIES: dict[str, tuple[str, Transcriber]] = {
    "whisper": ("Whisper", _whisper),
    "cohere_asr": (cohere_asr.FAMILY, cohere_asr.transcribe),
    "moonshine": (moonshine.FAMILY, moonshine.transcribe),
    "canary": (canary.FAMILY, canary.transcribe),
    "moonshine_streaming": (moonshine_streaming.FAMILY, moonshine_streaming.transcribe),
    "speech_to_text": (speech_to_text.FAMILY, speech_to_text.transcribe),
    "voxtral_realtime": (voxtral_realtime.FAMILY, voxtral_realtime.transcribe),
    "omniasr_ctc": (omniasr_ctc.FAMILY, omniasr_ctc.transcribe),
    "seamless_m4t_v2": (seamless_m4t.FAMILY, seamless_m4t.transcribe),
    "seamless_m4t": (seamless_m4t.FAMILY, seamless_m4t.transcribe),
    "parakeet_tdt": (parakeet.FAMILY, parakeet.transcribe),
    "parakeet_rnnt": (parakeet.FAMILY, parakeet.transcribe),
    "parakeet_ctc": (parakeet.FAMILY, parakeet.transcribe),
    "wav2vec2": (wav2vec2.FAMILY, wav2vec2.transcribe),
    "hubert": (wav2vec2.FAMILY, wav2vec2.transcribe),
    "data2vec-audio": (wav2vec2.FAMILY, wav2vec2.transcribe),
    "wavlm": (wav2vec2.FAMILY, wav2vec2.transcribe),
}


TIMESTAMPED: dict[str, Transcriber] = {
    "whisper": partial(_whisper, timestamps=True),
    "parakeet_tdt": partial(parakeet.transcribe, timestamps=True),
    "parakeet_rnnt": partial(parakeet.transcribe, timestamps=True),
}

# The families whose transcribers take words (word timestamps: Transcription.words).
WORD_TIMED = frozenset({"whisper", "parakeet_tdt", "parakeet_rnnt"})

# The families whose transcribers take temperature (openai-whisper's temperature fallback
# from it; None: none) and seed (its sampling's).
WHISPER_OPTIONS = frozenset({"whisper"})

# The families whose transcribers take num_beams: a beam search's, over the folder's.
BEAMED = frozenset(
    {
        "whisper",
        "cohere_asr",
        "moonshine",
        "canary",
        "moonshine_streaming",
        "speech_to_text",
        "seamless_m4t_v2",
        "seamless_m4t",
    }
)

# The families whose transcribers take target_language: the language of the text they write
# (a translation's), over the language spoken.
TARGETED = frozenset(seamless_m4t.MODEL_TYPES)

# The families that translate a clip only in a language given (they do not detect it):
# serve's /v1/audio/translations takes it as `language`.
TRANSLATE_FROM_LANGUAGE = frozenset({canary.FAMILY})


def family(model_type: str) -> tuple[str, Transcriber]:
    """The family's name and its transcriber."""
    if model_type not in FAMILIES:
        raise UnsupportedError(f"{model_type!r} is not a speech recognition family llmrun runs")
    return FAMILIES[model_type]
