"""Prompts with audio, for Phi-4-multimodal: each 16 kHz clip's log-mel frames as
transformers' Phi4MultimodalFeatureExtractor computes them (400-sample Hamming windows
every 160 samples, pre-emphasis 0.97 within each window, samples scaled to 16-bit, a
512-point FFT's power through 80 Kaldi-scale mel filters triangular in mel space up to
7690 Hz, floored at 1, natural log), encoded (llmrun.models.phi4mm_audio), and each audio
place the chat template marks (<|endoftext11|>, Phi-4-multimodal's audio token 200011)
repeated once per soft token, as Phi4MultimodalProcessor does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.phi4mm_audio import Phi4mmAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<|endoftext11|>"
# The model card's prompt for speech recognition.
INSTRUCTION = "Transcribe the audio clip into text."
WINDOW, HOP, N_FFT, MEL_BINS = 400, 160, 512, 80
PREEMPHASIS, TOP_HZ = 0.97, 7690.0


def _kaldi_mel(hz: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log(1.0 + np.asarray(hz) / 700.0)


@lru_cache(maxsize=1)
def mel_filters() -> torch.Tensor:
    """The filters [257 bins, 80] (audio_utils.mel_filter_bank with mel_scale "kaldi" and
    triangularize_in_mel_space): triangles in mel space over the bins' mel values."""
    centers = np.linspace(_kaldi_mel(0.0), _kaldi_mel(TOP_HZ), MEL_BINS + 2)
    bins = _kaldi_mel(audio.SAMPLE_RATE / N_FFT * np.arange(N_FFT // 2 + 1))
    slopes = centers[None, :] - bins[:, None]
    widths = np.diff(centers)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    return torch.from_numpy(np.maximum(0.0, np.minimum(down, up))).float()


def _frames(clip: audio.Clip) -> int:
    """How many windows a clip holds; refused where it holds none."""
    if len(clip.samples) < WINDOW:
        raise UsageError(f"{clip.name} is shorter than Phi-4-multimodal's 25 ms window")
    return (len(clip.samples) - WINDOW) // HOP + 1


def features(clip: audio.Clip) -> torch.Tensor:
    """A clip's log-mel frames [frames, 80] (at least one window long)."""
    _frames(clip)
    samples = torch.from_numpy(np.ascontiguousarray(clip.samples, dtype=np.float32))
    frames = samples.unfold(0, WINDOW, HOP)
    before = torch.roll(frames, 1, dims=-1)
    before[:, 0] = before[:, 1]
    frames = (frames - PREEMPHASIS * before) * 32768
    window = torch.hamming_window(WINDOW, periodic=False, dtype=torch.float64)
    spectrum = torch.fft.rfft(window * frames, n=N_FFT, dim=1).to(torch.complex64)
    power = spectrum.abs() ** 2
    return torch.log(torch.clamp(power @ mel_filters(), min=1.0))


def clip_tokens(encoder: Phi4mmAudio, clip: audio.Clip) -> int:
    """How many prompt tokens a clip takes: one per time_reduction frames, rounded up."""
    return -(-_frames(clip) // encoder.encoder.args.time_reduction)


@torch.inference_mode()
def encode(encoder: Phi4mmAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's soft tokens [tokens, hidden]."""
    return [encoder.encoder(features(clip)) for clip in clips]


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|endoftext11|> repeated for its clip's tokens, and the
    clips as generate() takes them. The text must mark exactly one place per clip."""
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, asked for the
    generation prompt) of a user turn of the clip and the model card's instruction. A
    language is refused: the instruction names none."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not Phi-4-multimodal's")
    if language is not None:
        raise UsageError(
            f"language {language!r}: Phi-4-multimodal's transcription prompt takes no language "
            "(it transcribes the language it hears): leave language out"
        )
    content = [{"type": "audio"}, {"type": "text", "text": INSTRUCTION}]
    return render([{"role": "user", "content": content}], add_generation_prompt=True)
