"""Canary's speech recognition and translation (llmrun.models.canary), as transformers'
CanaryProcessor prepares a clip and CanaryForConditionalGeneration.generate decodes it
(greedily, or by beam search): the clip's features as ParakeetFeatureExtractor computes them
(Parakeet's normalized log-mel: llmrun.nemotron_omni_clips.features, no dither), the decoder
prompt apply_transcription_request renders for the clip's language (which the model does not
detect: it must be given), the text's language (the clip's, or English for a translation)
and punctuation, decoding by llmrun.seq2seq, and the text decoded without special tokens, as
batch_decode(skip_special_tokens=True). The processor does not split a long clip: it is
encoded whole.

Reference: transformers/models/canary/processing_canary.py (LANGUAGE_CODE_TO_NAME,
apply_transcription_request), tests/models/canary/test_processing_canary.py (the prompt
the Hub's chat template renders), models/parakeet/feature_extraction_parakeet.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, cohere_asr, nemotron_omni_clips, seq2seq
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "Canary"
LANGUAGES = (
    "bg", "cs", "da", "de", "el", "en", "es", "et", "fi", "fr", "hr", "hu", "it",
    "lt", "lv", "mt", "nl", "pl", "pt", "ro", "ru", "sk", "sl", "sv", "uk",
)  # fmt: skip
EXTRACTOR = "ParakeetFeatureExtractor"
FEATURE_SIZE = 80  # ParakeetFeatureExtractor's default
TASKS = ("transcribe", "translate")


def feature_size(folder: Path) -> int:
    """The folder's ParakeetFeatureExtractor's feature_size, its settings checked against
    what llmrun.nemotron_omni_clips.features computes."""
    file, values = feature_extractor(folder)
    kind = values.get("feature_extractor_type", EXTRACTOR)
    if kind != EXTRACTOR:
        raise UnsupportedError(f"{file}: feature_extractor_type {kind!r}, not {EXTRACTOR}")
    fixed = cohere_asr.FIXED
    odd = [f"{k} {values[k]!r}" for k, v in fixed.items() if values.get(k, v) != v]
    if odd:
        raise UnsupportedError(f"{file}: {', '.join(odd)} (llmrun computes {fixed})")
    size = values.get("feature_size", FEATURE_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ModelFormatError(f"{file}: feature_size {size!r}")
    return size


def features(samples: np.ndarray, mel_bins: int) -> torch.Tensor:
    """A clip's features [len // 160 + 1, mel_bins], the last frame outside the mask."""
    if len(samples) < 2 * nemotron_omni_clips.HOP:
        raise UsageError(
            f"{len(samples)} samples of audio: under {2 * nemotron_omni_clips.HOP} (20 ms), "
            "too short to transcribe"
        )
    return nemotron_omni_clips.features(samples, mel_bins)


def prompt_ids(tokenizer: Tokenizer, source: str, target: str) -> list[int]:
    """The decoder prompt apply_transcription_request(source_language=source,
    target_language=target, punctuation=True) makes."""
    pieces = [
        "<|startofcontext|>",
        "<|startoftranscript|>",
        "<|emo:undefined|>",
        f"<|{source}|>",
        f"<|{target}|>",
        "<|pnc|>",
        "<|noitn|>",
        "<|notimestamp|>",
        "<|nodiarize|>",
    ]
    return cohere_asr.token_ids(tokenizer, pieces, FAMILY)


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
    """A clip's transcript (or English translation, with task "translate") by a Canary
    `model` loaded from `folder`; `language`: the clip's."""
    if task not in (None, *TASKS):
        raise UsageError(f"task {task!r}: {FAMILY}'s are {' and '.join(TASKS)}")
    if prompt:
        raise UsageError(f"{FAMILY} takes no prompt before the audio")
    source = cohere_asr.language_code(language, FAMILY, LANGUAGES)
    target = "en" if task == "translate" else source
    settings = seq2seq.Settings.of(generation, config, FAMILY, num_beams)
    mel_bins = feature_size(folder)
    if mel_bins != model.encoder_args.num_mel_bins:
        raise ModelFormatError(
            f"{folder}: the feature extractor's feature_size {mel_bins}, and the encoder "
            f"takes {model.encoder_args.num_mel_bins} mel bins"
        )
    prompt_tokens = settings.prompt(prompt_ids(tokenizer, source, target))
    norm = model.model.decoder.norm.weight
    with torch.inference_mode():
        x = features(clip.samples, mel_bins)
        encoded = model.encode(x.to(norm.device, norm.dtype), x.shape[0] - 1)
        ids = seq2seq.generate(model, encoded, prompt_tokens, settings)
    text = tokenizer.decode(prompt_tokens + ids, skip_special=True)
    return Transcription(text, ids, source, len(prompt_tokens))
