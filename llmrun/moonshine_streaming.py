"""Moonshine Streaming's speech recognition (llmrun.models.moonshine_streaming), as
transformers' MoonshineStreamingProcessor prepares a clip (Wav2Vec2FeatureExtractor: the raw
16 kHz samples zero-padded to whole 5 ms frames, zero-mean unit-variance where its
do_normalize says, over the clip's samples where it returns an attention mask and over the
padded ones where it does not) and MoonshineStreamingForConditionalGeneration.generate
decodes it (greedily, or by beam search) as Moonshine's (llmrun.moonshine: from
decoder_start_token_id, up to 6.5 tokens a second where generation_config.json gives no
length). The clip is encoded whole: llmrun does not stream it. The model takes no language,
task or prompt.

Reference: transformers/models/moonshine_streaming/processing_moonshine_streaming.py,
models/wav2vec2/feature_extraction_wav2vec2.py (zero_mean_unit_var_norm).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from llmrun import audio, moonshine
from llmrun.errors import UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.models.moonshine_streaming import FRAME, positions
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "Moonshine Streaming"


def masks(folder: Path) -> bool:
    """The feature extractor's return_attention_mask (Wav2Vec2FeatureExtractor's default:
    false), which decides whether the encoder attends in its sliding windows."""
    return bool(feature_extractor(folder)[1].get("return_attention_mask", False))


def samples(clip: audio.Clip, normalize: bool, masked: bool) -> np.ndarray:
    """The clip's samples as the feature extractor gives them (float32), zero-padded to
    whole frames."""
    x = np.asarray(clip.samples, dtype=np.float32)
    if len(x) < FRAME:
        raise UsageError(f"{clip.name}: too short for {FAMILY} (under 5 ms)")

    def normalized(y: np.ndarray) -> np.ndarray:
        return (y - y.mean()) / np.sqrt(y.var() + 1e-7) if normalize else y

    padding = (0, -len(x) % FRAME)
    if masked:
        return np.pad(normalized(x), padding)
    return normalized(np.pad(x, padding))


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
    """A clip's transcript by a Moonshine Streaming `model` loaded from `folder`."""
    moonshine.refuse(language, task, prompt, FAMILY)
    masked = masks(folder)
    x = samples(clip, moonshine.normalizes(folder), masked)
    most = model.args.max_position_embeddings
    if positions(len(x)) > most:
        raise UsageError(
            f"{clip.name}: {len(x) / audio.SAMPLE_RATE:.1f} s, over the {most * 0.02:.1f} s "
            f"{FAMILY} encodes ({most} positions of 20 ms)"
        )
    frames = len(clip.samples) // FRAME if masked else None
    encode = partial(model.encode, frames=frames)
    return moonshine.transcript(
        model, tokenizer, folder, generation, config, x, encode, FAMILY, num_beams
    )
