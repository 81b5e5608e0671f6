"""Voxtral Realtime's speech recognition (llmrun.models.voxtral_realtime), as transformers'
VoxtralRealtimeProcessor prepares a clip (mistral_common's offline streaming transcription
request) and VoxtralRealtimeForConditionalGeneration.generate decodes it greedily.

The clip is padded with silence as mistral_common pads it: on the left by the tokenizer's
streaming_n_left_pad_tokens tokens of audio (1280 samples each at 12.5 tokens a second),
on the right to a whole token and then by the transcription delay's tokens, one more and
a buffer of 10. Its log-mel spectrogram is Whisper's with the maximum fixed at the feature
extractor's global_log_mel_max (1.5). The prompt is <s> and a [STREAMING_PAD] for each
left pad and delay token; every position, the prompt's and each generated one's, adds its
audio token to its embedding, and the decoder's MLPs are conditioned on the delay. It
decodes until </s> or until every audio token is read (generate's default max_length),
and the text is decoded without special tokens ([STREAMING_PAD], [STREAMING_WORD]).
It takes no language, prompt or translation.

The settings come from the folder's tekken.json "audio" (mistral_common's AudioConfig).

Reference: transformers/models/voxtral_realtime/processing_voxtral_realtime.py,
feature_extraction_voxtral_realtime.py, modeling_voxtral_realtime.py (generate's
_prepare_generation_config); mistral_common/tokens/tokenizers/audio.py (AudioConfig,
_get_streaming_pad, encode_streaming_tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrun import audio, seq2seq
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import feature_extractor
from llmrun.models.voxtral_realtime import delay_embedding
from llmrun.tokenizer import Tokenizer
from llmrun.whisper import Transcription

FAMILY = "Voxtral Realtime"
PAD = "[STREAMING_PAD]"
BUFFER_TOKENS = 10  # mistral_common's OFFLINE_STREAMING_BUFFER_TOKENS


@dataclass(frozen=True)
class Streaming:
    """tekken.json's streaming audio settings."""

    frame_rate: float
    delay_ms: float
    left_pad_tokens: int

    @property
    def samples_per_token(self) -> int:
        return int(audio.SAMPLE_RATE // self.frame_rate)

    @property
    def delay_tokens(self) -> int:
        """AudioConfig.get_num_delay_tokens: the delay's samples in tokens."""
        samples = int(self.delay_ms / 1000.0 * audio.SAMPLE_RATE)
        frames = (
            math.ceil(samples / audio.HOP_LENGTH - 1)
            if samples % audio.HOP_LENGTH
            else samples // audio.HOP_LENGTH
        )
        return math.ceil(frames / (self.samples_per_token // audio.HOP_LENGTH))

    @classmethod
    def of(cls, folder: Path) -> Streaming:
        file = folder / "tekken.json"
        if not file.is_file():
            raise ModelFormatError(
                f"{folder}: no tekken.json, which holds {FAMILY}'s audio settings"
            )
        settings = safetensors_io.read_json(file).get("audio")
        if not isinstance(settings, dict) or settings.get("transcription_format") != "streaming":
            raise ModelFormatError(f'{file}: no streaming "audio" settings')
        encoding = settings.get("audio_encoding_config") or {}
        expected = {"sampling_rate": audio.SAMPLE_RATE}
        found = {"sampling_rate": settings.get("sampling_rate")}
        expected.update(hop_length=audio.HOP_LENGTH, window_size=audio.N_FFT)
        found.update(hop_length=encoding.get("hop_length"), window_size=encoding.get("window_size"))
        if found != expected:
            raise UnsupportedError(f"{file}: audio {found}; llmrun takes {FAMILY}'s {expected}")
        values = (
            settings.get("frame_rate"),
            settings.get("transcription_delay_ms"),
            settings.get("streaming_n_left_pad_tokens"),
        )
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values
        ):
            raise ModelFormatError(
                f"{file}: frame_rate, transcription_delay_ms, streaming_n_left_pad_tokens {values}"
            )
        streaming = cls(float(values[0]), float(values[1]), int(values[2]))
        if (
            streaming.samples_per_token % audio.HOP_LENGTH
            or streaming.samples_per_token < audio.HOP_LENGTH
        ):
            raise UnsupportedError(
                f"{file}: frame_rate {values[0]}: not a whole number of mel frames a token"
            )
        return streaming

    def padded(self, samples: np.ndarray) -> np.ndarray:
        """The samples with mistral_common's silence before and after them."""
        per_token = self.samples_per_token
        right = (per_token - len(samples) % per_token) % per_token
        right += per_token * (self.delay_tokens + 1 + BUFFER_TOKENS)
        left = per_token * self.left_pad_tokens
        return np.concatenate(
            [np.zeros(left, np.float32), samples.astype(np.float32), np.zeros(right, np.float32)]
        )


def _log_mel_max(folder: Path, mel_bins: int) -> float:
    """The feature extractor's global_log_mel_max (VoxtralRealtimeFeatureExtractor's default
    1.5), its other settings checked against those llmrun computes."""
    file, values = feature_extractor(folder)
    for key, expected in (
        ("sampling_rate", audio.SAMPLE_RATE),
        ("hop_length", audio.HOP_LENGTH),
        ("n_fft", audio.N_FFT),
        ("win_length", audio.N_FFT),
        ("feature_size", mel_bins),
    ):
        if values.get(key, expected) != expected:
            raise UnsupportedError(f"{file}: {key} {values[key]!r}; llmrun computes {expected}")
    value = values.get("global_log_mel_max", 1.5)
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedError(f"{file}: global_log_mel_max {value!r}: llmrun takes a number")
    return float(value)


def prompt_ids(tokenizer: Tokenizer, streaming: Streaming) -> list[int]:
    """<s> and a [STREAMING_PAD] for each left pad and delay token."""
    pad = tokenizer.token_id(PAD)
    if pad is None or tokenizer.bos_id is None:
        raise ModelFormatError(f"the tokenizer has no <s> or {PAD}: not {FAMILY}'s")
    return [tokenizer.bos_id] + [pad] * (streaming.left_pad_tokens + streaming.delay_tokens)


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
    """A clip's transcript by a Voxtral Realtime `model` loaded from `folder`."""
    if language is not None:
        raise UsageError(f"{FAMILY} takes no language (it transcribes the language it hears)")
    seq2seq.only_transcribes(task, prompt, FAMILY)
    args = model.args
    streaming = Streaming.of(folder)
    if streaming.samples_per_token // audio.HOP_LENGTH != args.audio_length_per_tok:
        raise ModelFormatError(
            f"{folder}: tekken.json's {streaming.samples_per_token} samples a token are not the "
            f"model's audio_length_per_tok {args.audio_length_per_tok} mel frames"
        )
    ids = prompt_ids(tokenizer, streaming)
    features = audio.log_mel(
        streaming.padded(clip.samples), args.num_mel_bins, _log_mel_max(folder, args.num_mel_bins)
    )
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = (config.get("text_config") or {}).get("eos_token_id", 2)
    stops = set(eos if isinstance(eos, list) else [eos])
    weight = model.model.norm.weight
    with torch.inference_mode():
        tokens = model.encode(torch.from_numpy(features).to(weight.device, weight.dtype))
        total = len(tokens)
        keys = model.new_keys(total)
        delay = delay_embedding(streaming.delay_tokens, args.text.hidden_size).to(weight)
        positions = torch.arange(len(ids), device=weight.device)
        step = torch.tensor(ids, device=weight.device)
        generated: list[int] = []
        while len(ids) + len(generated) < total:
            logits = model.step(step, tokens[positions], positions, keys, delay)
            token = int(logits[-1].argmax())
            if token in stops:
                break
            generated.append(token)
            at = len(ids) + len(generated) - 1
            positions = torch.tensor([at], device=weight.device)
            step = torch.tensor([token], device=weight.device)
    text = tokenizer.decode(generated, skip_special=True)
    return Transcription(text, generated, None, len(ids))
