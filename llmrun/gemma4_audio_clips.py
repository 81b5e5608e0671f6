"""Prompts with audio, for Gemma 4 (E2B, E4B): each clip's log-mel features as
Gemma4AudioFeatureExtractor computes them, and each audio place the chat template marks
(<|audio|>) expanded as Gemma4Processor expands it: <|audio>, one <|audio|> per soft
token, <audio|>. The clips' embeddings go where multimodal.PromptImages says; unlike an
image's, a clip's tokens attend causally (the processor's token type 3 is not a vision
type, and llama.cpp decodes Gemma 4's audio causally).

The feature extractor pads a clip to a multiple of 128 samples, frames it semicausally
(160 zeros first; 320-sample periodic Hann windows every 160 samples, an FFT of 512),
takes each frame's magnitude spectrum through an HTK mel bank without norm, log(mel +
mel_floor), and zeroes the frames whose window reaches past the audio; the encoder's
two stride-2 convolutions make a token of four frames. It cuts a clip past 30 seconds:
llmrun refuses one instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmrun import audio
from llmrun.errors import TokenizerError, UsageError
from llmrun.models.gemma3 import ImageTokens
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

if TYPE_CHECKING:  # the loader imports FeatureSettings from here
    from llmrun.loading.gemma4_audio import Gemma4Audio

AUDIO_BEGIN, AUDIO_SOFT, AUDIO_END = "<|audio>", "<|audio|>", "<audio|>"
MAX_SAMPLES = 30 * audio.SAMPLE_RATE  # the feature extractor's max_length
PAD_TO = 128  # its pad_to_multiple_of


@dataclass(frozen=True)
class FeatureSettings:
    """Gemma4AudioFeatureExtractor's settings (its defaults, which llama.cpp's mmproj
    path assumes too)."""

    feature_size: int = 128
    frame_length: int = 320  # 20 ms
    hop_length: int = 160  # 10 ms
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None

    @property
    def fft_length(self) -> int:
        length = 2 ** math.ceil(math.log2(self.frame_length))
        return length * 2 if self.fft_overdrive else length


def mel_filters(settings: FeatureSettings) -> np.ndarray:
    """The HTK mel bank [fft_length // 2 + 1, feature_size] without norm (transformers'
    mel_filter_bank(norm=None, mel_scale="htk"))."""
    bins = settings.fft_length // 2 + 1
    fft_freqs = np.linspace(0, audio.SAMPLE_RATE // 2, bins)
    low, high = (2595.0 * np.log10(1.0 + f / 700.0)
                 for f in (settings.min_frequency, settings.max_frequency))  # fmt: skip
    mels = np.linspace(low, high, settings.feature_size + 2)
    edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


def frames(samples: int, settings: FeatureSettings) -> tuple[int, int]:
    """How many feature frames a clip of `samples` samples gives (its length padded to a
    multiple of 128, 160 zeros first), and how many of the first are its audio (a frame
    is where its window's last sample is); a clip past 30 seconds or without one frame of
    audio for a token is refused."""
    if samples > MAX_SAMPLES:
        raise UsageError(
            f"{samples / audio.SAMPLE_RATE:.1f} seconds of audio; Gemma 4 takes "
            f"{MAX_SAMPLES // audio.SAMPLE_RATE} seconds a clip at most (cut it into clips)"
        )
    frame, hop = settings.frame_length, settings.hop_length
    left = frame // 2
    count = (left + -(-samples // PAD_TO) * PAD_TO - (frame + 1)) // hop + 1
    valid = min(max(count, 0), max(-(-(left + samples - frame) // hop), 0))
    if valid == 0:
        raise UsageError(f"{samples} samples, too short for Gemma 4")
    return count, valid


def _frames(clip: audio.Clip, settings: FeatureSettings) -> tuple[int, int]:
    try:
        return frames(len(clip.samples), settings)
    except UsageError as e:
        raise UsageError(f"{clip.name}: {e}") from None


def features(clip: audio.Clip, settings: FeatureSettings) -> tuple[np.ndarray, int]:
    """A clip's log-mel features [frames, feature_size] (float32) and how many of the
    first frames are its audio (the rest are zeros), as the feature extractor gives them."""
    count, valid = _frames(clip, settings)
    frame, hop = settings.frame_length, settings.hop_length
    samples = len(clip.samples)
    left = frame // 2
    wave = np.zeros(left + -(-samples // PAD_TO) * PAD_TO, dtype=np.float32)
    wave[left : left + samples] = clip.samples
    wave = wave * np.float32(settings.input_scale_factor)
    windows = np.lib.stride_tricks.as_strided(
        wave, (count, frame + 1), (wave.strides[0] * hop, wave.strides[0])
    )
    p = settings.preemphasis
    if p > 0.0 and settings.preemphasis_htk_flavor:
        first = windows[:, :1] * (1.0 - p)
        windows = np.concatenate([first, windows[:, 1:-1] - p * windows[:, :-2]], axis=-1)
    elif p > 0.0:
        windows = windows[:, 1:] - p * windows[:, :-1]
    else:
        windows = windows[:, :-1]
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(frame) / frame)).astype(np.float32)
    magnitude = np.abs(np.fft.rfft(windows * hann, n=settings.fft_length, axis=-1))
    logs = np.log(magnitude @ mel_filters(settings) + np.float64(settings.mel_floor))
    if settings.per_bin_mean is not None:
        logs = logs - np.asarray(settings.per_bin_mean)
    if settings.per_bin_stddev is not None:
        logs = logs / np.asarray(settings.per_bin_stddev)
    out = logs.astype(np.float32)
    out[valid:] = 0.0
    return out, valid


def clip_tokens(encoder: Gemma4Audio, clip: audio.Clip) -> int:
    """The <|audio|> tokens a clip takes, as Gemma4Processor counts them: each stride-2
    convolution halves its audio's frames, rounding up."""
    return (_frames(clip, encoder.settings)[1] + 3) // 4


@torch.inference_mode()
def encode(encoder: Gemma4Audio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's soft tokens [tokens, text hidden]."""
    out = []
    for clip in clips:
        mel, valid = features(clip, encoder.settings)
        out.append(encoder.encoder(torch.from_numpy(mel), valid))
    return out


class CausalTokens(ImageTokens):
    """A clip's soft tokens: placed as an image's are, but attending causally."""

    def unmask(self, frames: dict, window: int | None) -> dict:
        return frames


class PromptAudio(PromptImages):
    """Where a prompt's clips go, their tokens attending causally."""

    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        tokens = super().tokens(begin, end, device)
        return None if tokens is None else CausalTokens(tokens.embeds, tokens.groups)


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|audio|> expanded for its clip's soft tokens between
    <|audio> and <audio|>, and where each clip's embeddings begin. The text must mark
    exactly one place per clip."""
    missing = [t for t in (AUDIO_BEGIN, AUDIO_SOFT, AUDIO_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Gemma 4's")
    soft = tokenizer.token_id(AUDIO_SOFT)
    pieces = clip_places(text, AUDIO_SOFT, len(embeds))
    expanded = pieces[0] + "".join(
        f"{AUDIO_BEGIN}{AUDIO_SOFT * len(e)}{AUDIO_END}{piece}"
        for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts, found = runs(ids, soft)
    if found != [len(e) for e in embeds]:
        raise TokenizerError(f"the tokenizer does not keep {AUDIO_SOFT} whole: not Gemma 4's")
    return ids, PromptAudio(list(embeds), starts)


def clip_places(text: str, place: str, clips: int) -> list[str]:
    """The pieces of `text` around its audio places (each a `place`), refused unless they
    are `clips`, one per clip."""
    pieces = text.split(place)
    places = len(pieces) - 1
    if places != clips:
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({place}) for "
            f"{clips} clip{'s' * (clips != 1)}: write one {place} where each goes"
        )
    return pieces


def runs(ids: Sequence[int], token: int) -> tuple[list[int], list[int]]:
    """Where each run of `token` in `ids` begins, and how long each is."""
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    lengths = [
        next((j for j in range(s, len(ids)) if ids[j] != token), len(ids)) - s for s in starts
    ]
    return starts, lengths
