"""Moonshine's speech recognition (llmrun.models.moonshine), as transformers' processor
(Wav2Vec2FeatureExtractor: the raw 16 kHz samples, zero-mean unit-variance where its
do_normalize says) prepares a clip and MoonshineForConditionalGeneration.generate decodes it
from decoder_start_token_id (greedily, or by beam search: llmrun.seq2seq), the text decoded
without special tokens, as batch_decode(skip_special_tokens=True). The model takes no
language, task or prompt.

Where generation_config.json gives no max_length or max_new_tokens, a transcript is cut at
the model card's 6.5 tokens per second of audio (generate's max_length =
int(samples * 6.5 / 16000)), which keeps a looping decoder from running to the end of
its positions.

Reference: transformers/models/moonshine/modeling_moonshine.py,
models/wav2vec2/feature_extraction_wav2vec2.py (zero_mean_unit_var_norm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, seq2seq
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.models.moonshine import positions
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "Moonshine"
EXTRACTOR = "Wav2Vec2FeatureExtractor"
TOKENS_PER_SECOND = 6.5  # the model card's limit


def normalizes(folder: Path) -> bool:
    """The feature extractor's do_normalize (Wav2Vec2FeatureExtractor's default: true)."""
    file, values = feature_extractor(folder)
    kind = values.get("feature_extractor_type", EXTRACTOR)
    rate = values.get("sampling_rate", audio.SAMPLE_RATE)
    if kind != EXTRACTOR or rate != audio.SAMPLE_RATE or values.get("feature_size", 1) != 1:
        raise UnsupportedError(
            f"{file}: {kind} at {rate} Hz; llmrun takes Moonshine's {EXTRACTOR} of 16 kHz samples"
        )
    return bool(values.get("do_normalize", True))


def samples(clip: audio.Clip, normalize: bool) -> np.ndarray:
    """The clip's samples as the feature extractor gives them (float32)."""
    x = np.asarray(clip.samples, dtype=np.float32)
    if positions(len(x)) < 1:
        raise UsageError(f"{clip.name}: too short for {FAMILY} (under 56 ms)")
    return (x - x.mean()) / np.sqrt(x.var() + 1e-7) if normalize else x


def transcribe(
    model: Any,
    tokenizer: Tokenizer,
    folder: Path,
    generation: dict[str, Any],
    config: dict[str, Any],
    clip: audio.Clip,
    language: str | None = None,
    task: str | None = None,
    prompt: str | None = None,
    num_beams: int | None = None,
) -> Transcription:
    """A clip's transcript by a Moonshine `model` loaded from `folder`."""
    refuse(language, task, prompt, FAMILY)
    x = samples(clip, normalizes(folder))
    return transcript(
        model, tokenizer, folder, generation, config, x, model.encode, FAMILY, num_beams
    )


def refuse(language: str | None, task: str | None, prompt: str | None, family: str) -> None:
    """What a Moonshine family's models do not take: a language, a translation, a prompt."""
    if language is not None:
        raise UsageError(f"{family} takes no language (its models are each one language's)")
    seq2seq.only_transcribes(task, prompt, family)


def transcript(
    model: Any,
    tokenizer: Tokenizer,
    folder: Path,
    generation: dict[str, Any],
    config: dict[str, Any],
    x: np.ndarray,
    encode: Callable[[torch.Tensor], torch.Tensor],
    family: str,
    num_beams: int | None = None,
) -> Transcription:
    """The transcript of samples `x` (as the feature extractor gives them) that `encode`
    ([1, samples] -> [1, positions, width]) encodes, decoded from the decoder start token
    (greedily, or with `num_beams`, else the file's), up to the model card's 6.5 tokens a
    second where the file gives no length."""
    settings = seq2seq.Settings.of(generation, config, family, num_beams)
    if settings.start is None:
        raise ModelFormatError(f"{folder}: no decoder_start_token_id")
    if settings.max_length is None and settings.max_new_tokens is None:
        limit = int(len(x) * TOKENS_PER_SECOND / audio.SAMPLE_RATE)
        settings = dataclasses.replace(settings, max_length=max(limit, 2))
    prompt_tokens = settings.prompt([])
    norm = model.model.decoder.norm.weight
    with torch.inference_mode():
        encoded = encode(torch.from_numpy(x)[None].to(norm.device, norm.dtype))
        ids = seq2seq.generate(model, encoded, prompt_tokens, settings)
    text = tokenizer.decode(prompt_tokens + ids, skip_special=True)
    return Transcription(text, ids, None, len(prompt_tokens))
