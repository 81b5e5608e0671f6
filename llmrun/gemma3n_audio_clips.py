"""Prompts with audio, for Gemma 3n (E2B, E4B): each clip's log-mel features as
Gemma3nAudioFeatureExtractor computes them, and each audio place the chat template marks
(<audio_soft_token>) expanded as Gemma3nProcessor expands it: a blank line,
<start_of_audio>, a fixed number of <audio_soft_token> (audio_soft_tokens_per_image, 188:
30 seconds' worth), <end_of_audio>, a blank line. The clip's soft tokens fill the first
places; the rest, and <end_of_audio>, take the audio embedder's own token embeddings, as
Gemma3nModel.forward gives them. A clip's tokens attend causally, as the rest of the
prompt does.

The feature extractor pads a clip to a multiple of 128 samples, cuts it into 512-sample
frames every 160 samples (a periodic Hann window, HTK preemphasis, an FFT of 1024), takes
each frame's magnitude spectrum through an HTK mel bank (125 Hz to 7.6 kHz) without norm,
and log(max(mel, mel_floor)); a frame is the clip's audio where its first sample is. Each
clip is encoded alone (transformers pads a batch's clips to the longest, which moves a
shorter clip's last token). It cuts a clip past 30 seconds: llmrun refuses one instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmrun import audio, gemma4_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.gemma4_audio_clips import PromptAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

if TYPE_CHECKING:  # the loader imports FeatureSettings from here
    from llmrun.loading.gemma3n_audio import Gemma3nAudio

AUDIO_BEGIN, AUDIO_SOFT, AUDIO_END = "<start_of_audio>", "<audio_soft_token>", "<end_of_audio>"
MAX_SAMPLES = 30 * audio.SAMPLE_RATE  # the feature extractor's max_length
PAD_TO = 128  # its pad_to_multiple_of


@dataclass(frozen=True)
class FeatureSettings(gemma4_audio_clips.FeatureSettings):
    """Gemma3nAudioFeatureExtractor's settings (its defaults)."""

    frame_length: int = 512  # 32 ms
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    fft_overdrive: bool = True
    mel_floor: float = 1e-5


def mel_filters(settings: FeatureSettings) -> np.ndarray:
    """The HTK mel bank [fft_length // 2 + 1, feature_size] without norm, as the feature
    extractor's create_fb_matrix builds it (its FFT frequencies in float32)."""
    bins = settings.fft_length // 2 + 1
    fft_freqs = np.arange(bins, dtype=np.float32) * (audio.SAMPLE_RATE / settings.fft_length)
    low, high = (2595.0 * np.log10(1.0 + f / 700.0)
                 for f in (settings.min_frequency, settings.max_frequency))  # fmt: skip
    mels = np.linspace(low, high, settings.feature_size + 2)
    edges = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -1.0 * slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1, dtype=np.float32), np.minimum(down, up))


def frames(samples: int, settings: FeatureSettings) -> tuple[int, int]:
    """How many feature frames a clip of `samples` samples gives (its length padded to a
    multiple of 128) and how many of the first are its audio; a clip past 30 seconds, or
    shorter than a frame, is refused."""
    if samples > MAX_SAMPLES:
        raise UsageError(
            f"{samples / audio.SAMPLE_RATE:.1f} seconds of audio; Gemma 3n takes "
            f"{MAX_SAMPLES // audio.SAMPLE_RATE} seconds a clip at most (cut it into clips)"
        )
    padded = -(-samples // PAD_TO) * PAD_TO
    count = max((padded - (settings.frame_length + 1)) // settings.hop_length + 1, 0)
    valid = min(count, -(-samples // settings.hop_length))
    if valid == 0:
        raise UsageError(f"{samples} samples, too short for Gemma 3n")
    return count, valid


def _frames(clip: audio.Clip, settings: FeatureSettings) -> tuple[int, int]:
    try:
        return frames(len(clip.samples), settings)
    except UsageError as e:
        raise UsageError(f"{clip.name}: {e}") from None


def features(clip: audio.Clip, settings: FeatureSettings) -> tuple[np.ndarray, int]:
    """A clip's log-mel features [frames, feature_size] (float32) and how many of the
    first frames are its audio, as the feature extractor gives them for the clip alone."""
    count, valid = _frames(clip, settings)
    frame, hop = settings.frame_length, settings.hop_length
    samples = len(clip.samples)
    wave = np.zeros(-(-samples // PAD_TO) * PAD_TO, dtype=np.float32)
    wave[:samples] = clip.samples
    if settings.input_scale_factor != 1.0:
        wave = wave * settings.input_scale_factor
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
    hann = 0.5 * (1 - np.cos(2 * np.pi * np.arange(frame, dtype=np.float32) / frame))
    magnitude = np.abs(np.fft.rfft(windows * hann.astype(np.float32), n=settings.fft_length))
    mel = magnitude @ mel_filters(settings)
    logs = np.log(np.maximum(mel, np.float64(settings.mel_floor)))
    if settings.per_bin_mean is not None:
        logs = logs - np.asarray(settings.per_bin_mean)
    if settings.per_bin_stddev is not None:
        logs = logs / np.asarray(settings.per_bin_stddev)
    return logs.astype(np.float32), valid


def _soft_tokens(encoder: Gemma3nAudio, clip: audio.Clip) -> int:
    """The tokens a clip's audio gives: one per time_stride * reduction frames."""
    args = encoder.encoder.args
    per_token = args.time_stride * args.conf_reduction_factor
    tokens = -(-_frames(clip, encoder.settings)[1] // per_token)
    if tokens > encoder.tokens_per_clip:
        raise UsageError(
            f"{clip.name}: {tokens} audio tokens, more than the {encoder.tokens_per_clip} "
            "Gemma 3n takes a clip (cut it into clips)"
        )
    return tokens


def clip_tokens(encoder: Gemma3nAudio, clip: audio.Clip) -> int:
    """The <audio_soft_token> places a clip takes, as Gemma3nProcessor counts them: the
    same for every clip (audio_soft_tokens_per_image)."""
    _soft_tokens(encoder, clip)
    return encoder.tokens_per_clip


@torch.inference_mode()
def encode(encoder: Gemma3nAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's embeddings [tokens per clip + 1, text hidden]: its soft tokens, the
    padding token's embedding up to the fixed count, then <end_of_audio>'s."""
    embed = encoder.encoder.embed_audio
    out = []
    for clip in clips:
        tokens = _soft_tokens(encoder, clip)
        mel, valid = features(clip, encoder.settings)
        soft = encoder.encoder(torch.from_numpy(mel), valid)[:tokens]
        padding = embed.hard(torch.tensor([encoder.padding_id]))
        end = embed.hard(torch.tensor([encoder.end_id]))
        rest = padding.expand(encoder.tokens_per_clip - len(soft), -1)
        out.append(torch.cat([soft, rest, end]))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <audio_soft_token> expanded for its clip between
    <start_of_audio> and <end_of_audio>, and where each clip's embeddings (from its first
    soft token through <end_of_audio>) begin. The text must mark exactly one place per
    clip."""
    missing = [t for t in (AUDIO_BEGIN, AUDIO_SOFT, AUDIO_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Gemma 3n's")
    soft, end = tokenizer.token_id(AUDIO_SOFT), tokenizer.token_id(AUDIO_END)
    pieces = gemma4_audio_clips.clip_places(text, AUDIO_SOFT, len(embeds))
    expanded = pieces[0] + "".join(
        f"\n\n{AUDIO_BEGIN}{AUDIO_SOFT * (len(e) - 1)}{AUDIO_END}\n\n{piece}"
        for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts, found = gemma4_audio_clips.runs(ids, soft)
    ends = [ids[s + n] if s + n < len(ids) else None for s, n in zip(starts, found, strict=True)]
    if found != [len(e) - 1 for e in embeds] or ends != [end] * len(embeds):
        raise TokenizerError(f"the tokenizer does not keep {AUDIO_SOFT} whole: not Gemma 3n's")
    return ids, PromptAudio(list(embeds), starts)
