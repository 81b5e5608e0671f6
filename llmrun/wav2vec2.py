"""wav2vec 2.0 speech recognition (llmrun.models.wav2vec2), as transformers'
Wav2Vec2Processor prepares a clip and Wav2Vec2ForCTC decodes it greedily: the clip's 16 kHz
samples in float32, normalized to zero mean and unit variance (+1e-7) where the feature
extractor's do_normalize says (its default), the whole clip through the model (the
processor does not split it), each frame's argmax, repeats collapsed and the blank (the
pad token) dropped; the text is the tokens' characters with the word delimiter a space,
stripped, as the processor's batch_decode gives it (special tokens kept, as its default).
wav2vec2 predicts no language and takes no prompt; it gives no times.

Reference: transformers/models/wav2vec2/feature_extraction_wav2vec2.py
(zero_mean_unit_var_norm), tokenization_wav2vec2.py (Wav2Vec2CTCTokenizer._decode,
convert_tokens_to_string).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, seq2seq
from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "wav2vec2"
EXTRACTOR = "Wav2Vec2FeatureExtractor"


def normalizes(folder: Path) -> bool:
    """The folder's Wav2Vec2FeatureExtractor's do_normalize, its other settings checked
    against what llmrun computes."""
    file, values = feature_extractor(folder)
    kind = values.get("feature_extractor_type", EXTRACTOR)
    if kind != EXTRACTOR:
        raise UnsupportedError(f"{file}: feature_extractor_type {kind!r}, not {EXTRACTOR}")
    fixed = dict(sampling_rate=audio.SAMPLE_RATE, feature_size=1)
    odd = [f"{k} {values[k]!r}" for k, v in fixed.items() if values.get(k, v) != v]
    if odd:
        raise UnsupportedError(f"{file}: {', '.join(odd)} (llmrun computes {fixed})")
    return bool(values.get("do_normalize", True))


def ctc_collapse(frame_ids: Iterable[int], dropped: Container[int | None] = ()) -> list[int]:
    """Greedy CTC decoding of each frame's argmax: each run of one id once, then the
    `dropped` ids (the blank, a pad token) left out."""
    return [token for token, _ in groupby(frame_ids) if token not in dropped]


def samples(clip_samples: np.ndarray, normalize: bool) -> torch.Tensor:
    """The model's input: the samples in float32, normalized where `normalize` says."""
    x = np.asarray(clip_samples, dtype=np.float32)
    if normalize:
        x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


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
) -> Transcription:
    """A clip's transcript by a wav2vec2 CTC `model` loaded from `folder`."""
    if language is not None:
        raise UsageError(f"{FAMILY} takes no language (it transcribes what it was tuned on)")
    seq2seq.only_transcribes(task, prompt, FAMILY)
    x = samples(clip.samples, normalizes(folder))
    if model.args.frames(len(x)) < 1:
        raise UsageError(f"{clip.name}: {len(x)} samples, too short for {FAMILY}'s convolutions")
    head = model.lm_head.weight
    with torch.inference_mode():
        best = model.logits(x.to(head.device, head.dtype)).argmax(-1).tolist()
    ids = ctc_collapse(best, {model.args.pad_token_id})
    return Transcription(tokenizer.decode(ids, skip_special=False).strip(), ids, None, 0)
