"""Speech2Text's speech recognition (llmrun.models.speech_to_text), as transformers'
Speech2TextProcessor prepares a clip and Speech2TextForConditionalGeneration.generate
decodes it (greedily, or by the beam search the folder or a request asks for): the clip's
features as Speech2TextFeatureExtractor computes them without torchaudio (Kaldi's fbank of
the samples scaled to 16-bit: 25 ms frames every 10 ms, edges snipped, each frame's mean
taken off, pre-emphasis 0.97, a Povey window, a 512-point FFT's power through Kaldi's mel
filters from 20 Hz to 8 kHz, natural log floored at float32's epsilon; then each mel bin's
mean and standard deviation over the clip taken out), decoding from decoder_start_token_id
(llmrun.seq2seq), and the text decoded without special tokens (its SentencePiece pieces
joined, uppercased where the tokenizer's do_upper_case says), as
batch_decode(skip_special_tokens=True). The English models take no language, task or prompt;
the multilingual ones (target-language codes) are not supported.

Reference: transformers/models/speech_to_text/feature_extraction_speech_to_text.py,
tokenization_speech_to_text.py (convert_tokens_to_string), audio_utils.py (spectrogram,
mel_filter_bank with mel_scale="kaldi", window_function "povey").
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, seq2seq
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading.vision import feature_extractor
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "Speech2Text"
EXTRACTOR = "Speech2TextFeatureExtractor"
WINDOW, HOP, N_FFT = 400, 160, 512
PREEMPHASIS, LOW_HZ = 0.97, 20.0
FLOOR = float(np.finfo(np.float32).eps)


def _mel(hz: np.ndarray | float) -> np.ndarray | float:
    return 1127.0 * np.log(1.0 + np.asarray(hz) / 700.0)


@lru_cache(maxsize=2)
def mel_filters(mel_bins: int) -> np.ndarray:
    """Kaldi's filters [N_FFT / 2 + 1 bins, mel_bins] (float64): triangles evenly spaced in
    mel between LOW_HZ and the Nyquist frequency."""
    edges = np.linspace(_mel(LOW_HZ), _mel(audio.SAMPLE_RATE / 2), mel_bins + 2)
    bins = _mel(np.arange(N_FFT // 2 + 1) * audio.SAMPLE_RATE / N_FFT)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    up = (bins[:, None] - left) / (center - left)
    down = (right - bins[:, None]) / (right - center)
    return np.maximum(0.0, np.minimum(up, down))


def features(samples: np.ndarray, mel_bins: int) -> torch.Tensor:
    """A clip's normalized log-mel features [frames, mel_bins] (float32)."""
    mel = log_mel(samples, mel_bins, FAMILY)
    mel = mel - mel.mean(axis=0)
    return torch.from_numpy(mel / mel.std(axis=0))


def log_mel(samples: np.ndarray, mel_bins: int, family: str) -> np.ndarray:
    """A clip's Kaldi log-mel filterbank [frames, mel_bins] (float32), before any
    normalization; a clip shorter than a frame is refused, naming the `family`."""
    if len(samples) < WINDOW:
        raise UsageError(f"{len(samples)} samples: shorter than {family}'s 25 ms frame")
    x = np.asarray(samples, dtype=np.float32) * 2**15  # Kaldi's 16-bit scale, in float32
    count = (len(x) - WINDOW) // HOP + 1
    frames = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), WINDOW)[::HOP]
    frames = frames[:count] - frames[:count].mean(axis=1, keepdims=True)
    before = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    window = np.hanning(WINDOW) ** 0.85  # Povey's
    power = np.abs(np.fft.rfft((frames - PREEMPHASIS * before) * window, n=N_FFT)) ** 2
    return np.log(np.maximum(power @ mel_filters(mel_bins), FLOOR)).astype(np.float32)


def extractor_settings(folder: Path) -> int:
    """The folder's Speech2TextFeatureExtractor's num_mel_bins, its settings checked against
    what `features` computes."""
    file, values = feature_extractor(folder)
    kind = values.get("feature_extractor_type", EXTRACTOR)
    if kind != EXTRACTOR:
        raise UnsupportedError(f"{file}: feature_extractor_type {kind!r}, not {EXTRACTOR}")
    fixed = dict(
        sampling_rate=audio.SAMPLE_RATE,
        dither=0.0,
        do_ceptral_normalize=True,
        normalize_means=True,
        normalize_vars=True,
    )
    odd = [f"{k} {values[k]!r}" for k, v in fixed.items() if values.get(k, v) != v]
    if odd:
        raise UnsupportedError(f"{file}: {', '.join(odd)} (llmrun computes {fixed})")
    bins = values.get("num_mel_bins", 80)
    if not isinstance(bins, int) or isinstance(bins, bool) or bins < 2:
        raise ModelFormatError(f"{file}: num_mel_bins {bins!r}")
    return bins


def upper_case(folder: Path) -> bool:
    """The tokenizer's do_upper_case; a multilingual tokenizer (lang_codes) is refused."""
    file = folder / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{file}: not a JSON object")
    if config.get("lang_codes") is not None:
        raise UnsupportedError(
            f"{file}: a multilingual {FAMILY} (target-language codes), which llmrun does not run"
        )
    return bool(config.get("do_upper_case", False))


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
    """A clip's transcript by a Speech2Text `model` loaded from `folder`."""
    if language is not None:
        raise UsageError(f"{FAMILY} takes no language (its English models transcribe English)")
    seq2seq.only_transcribes(task, prompt, FAMILY)
    upper = upper_case(folder)
    settings = seq2seq.Settings.of(generation, config, FAMILY, num_beams)
    if settings.start is None:
        raise ModelFormatError(f"{folder}: no decoder_start_token_id")
    mel_bins = extractor_settings(folder)
    if mel_bins != model.args.mel_bins:
        raise ModelFormatError(
            f"{folder}: the feature extractor's num_mel_bins {mel_bins}, and the model takes "
            f"{model.args.mel_bins}"
        )
    x = features(clip.samples, mel_bins)
    most = model.args.max_source_positions
    if model.model.encoder.conv.positions(len(x)) > most:
        raise UsageError(
            f"{clip.name}: {len(clip.samples) / audio.SAMPLE_RATE:.1f} s of audio, over the "
            f"{most} encoder positions {FAMILY} takes"
        )
    prompt_tokens = settings.prompt([])
    norm = model.model.decoder.layer_norm.weight
    with torch.inference_mode():
        encoded = model.encode(x[None].to(norm.device, norm.dtype))
        ids = seq2seq.generate(model, encoded, prompt_tokens, settings)
    text = tokenizer.decode(prompt_tokens + ids, skip_special=True).strip()
    return Transcription(text.upper() if upper else text, ids, None, len(prompt_tokens))
