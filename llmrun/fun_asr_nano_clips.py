"""Prompts with audio, for Fun-ASR-Nano: each clip's features as FunAsrNanoFeatureExtractor
computes them, encoded, and each audio place the chat template marks (one
<|object_ref_start|>) repeated once per token, as FunAsrNanoProcessor expands it.

The features are Kaldi's fbank as torchaudio.compliance.kaldi.fbank computes it with the
extractor's settings (25 ms frames every 10 ms, edges snipped, no dither, the mean taken
off each frame, pre-emphasis 0.97, a Hamming window, a 512-point FFT's power through mel
filters from 20 Hz to 8 kHz, natural log floored at float32's epsilon; the samples as
they are, not scaled to 16-bit), then low-frame-rate stacking: 7 frames every 6, centred
(the first frame repeated 3 times before, the last as often as the final window needs
after). A token per stacked frame (60 ms); the encoder's positions reach 2048 of them.

A transcription's prompt is FunAsrNanoProcessor.apply_transcription_request's through the
chat template: a user turn of the clip, the context text (OpenAI's `prompt`) where one is
given, and the language's name as the model was trained on it (语音转写成英文：) where one
is given (Chinese, English or Japanese); the answer is the transcription.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.fun_asr_nano import FunAsrNanoAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<|object_ref_start|>"
WINDOW, HOP, N_FFT = 400, 160, 512  # 25 ms, 10 ms, the window rounded up to a power of two
PREEMPHASIS, LOW_HZ = 0.97, 20.0
# FunAsrNanoProcessor's LANGUAGE_CODE_TO_NAME: the names its instruction was trained with.
LANGUAGES = {
    "zh": "中文",
    "chinese": "中文",
    "en": "英文",
    "english": "英文",
    "ja": "日文",
    "japanese": "日文",
}


def _mel(hz: torch.Tensor | float) -> torch.Tensor | float:
    if isinstance(hz, torch.Tensor):
        return 1127.0 * torch.log(1.0 + hz / 700.0)
    return 1127.0 * math.log(1.0 + hz / 700.0)


@lru_cache(maxsize=2)
def mel_filters(mel_bins: int) -> torch.Tensor:
    """Kaldi's filters [N_FFT / 2 + 1 bins, mel_bins]: triangles evenly spaced in mel
    between LOW_HZ and the Nyquist frequency (none on the Nyquist bin)."""
    low, high = _mel(LOW_HZ), _mel(audio.SAMPLE_RATE / 2)
    delta = (high - low) / (mel_bins + 1)
    left = low + torch.arange(mel_bins, dtype=torch.float32)[:, None] * delta
    center, right = left + delta, left + 2 * delta
    mel = _mel(audio.SAMPLE_RATE / N_FFT * torch.arange(N_FFT // 2, dtype=torch.float32))
    up, down = (mel - left) / (center - left), (right - mel) / (right - center)
    filters = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.cat([filters, torch.zeros(mel_bins, 1)], dim=1).T.contiguous()


def fbank(samples: np.ndarray, mel_bins: int) -> torch.Tensor:
    """Kaldi's log-mel fbank [frames, mel_bins] of 16 kHz samples (at least WINDOW)."""
    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    frames = x.unfold(0, WINDOW, HOP)
    frames = frames - frames.mean(dim=1, keepdim=True)
    before = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = (frames - PREEMPHASIS * before) * torch.hamming_window(WINDOW, periodic=False)
    power = torch.fft.rfft(frames, n=N_FFT).abs() ** 2
    return torch.log(torch.clamp(power @ mel_filters(mel_bins), min=torch.finfo(torch.float32).eps))


def stacked(frames: torch.Tensor, stack: int, stride: int) -> torch.Tensor:
    """Low-frame-rate frames [ceil(frames / stride), stack * mel bins]: `stack` frames
    every `stride`, centred, the edges repeated."""
    count = -(-len(frames) // stride)
    left = (stack - 1) // 2
    after = max(0, (count - 1) * stride + stack - left - len(frames))
    padded = torch.cat([frames[:1].expand(left, -1), frames, frames[-1:].expand(after, -1)])
    # [count, mel bins, stack] -> [count, stack * mel bins]: each window's frames in order
    windows = padded.unfold(0, stack, stride)[:count].transpose(1, 2)
    return windows.reshape(count, -1)


def features(encoder: FunAsrNanoAudio, clip: audio.Clip) -> torch.Tensor:
    """A clip's stacked fbank features [tokens, stack * mel bins]."""
    clip_tokens(encoder, clip)  # refuses a clip too short or too long
    mel_bins = encoder.encoder.args.num_mel_bins
    return stacked(fbank(clip.samples, mel_bins), encoder.stack, encoder.stride)


def clip_tokens(encoder: FunAsrNanoAudio, clip: audio.Clip) -> int:
    """The <|object_ref_start|> tokens a clip takes (a stacked frame each); a clip shorter
    than one 25 ms frame, or longer than the encoder's positions reach, is refused."""
    samples = len(clip.samples)
    if samples < WINDOW:
        raise UsageError(f"{clip.name} is shorter than Fun-ASR-Nano's 25 ms frame")
    tokens = -(-((samples - WINDOW) // HOP + 1) // encoder.stride)
    most = encoder.encoder.args.max_position_embeddings - 1
    if tokens > most:
        seconds = most * encoder.stride * HOP / audio.SAMPLE_RATE
        raise UsageError(
            f"{clip.name}: {samples / audio.SAMPLE_RATE:.1f} seconds of audio; Fun-ASR-Nano "
            f"takes {seconds:.1f} seconds a clip at most (cut it into clips)"
        )
    return tokens


@torch.inference_mode()
def encode(encoder: FunAsrNanoAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    return [encoder.encoder(features(encoder, clip)) for clip in clips]


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|object_ref_start|> repeated for its clip's tokens, and
    the clips as generate() takes them. The text must mark exactly one place per clip."""
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, asked for the
    generation prompt) of a user turn of the clip, the context text and the language's
    name, as apply_transcription_request writes it. A language other than Chinese, English
    or Japanese is refused."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not Fun-ASR-Nano's")
    content: list[dict] = [{"type": "audio"}]
    if context is not None:
        content.append({"type": "text", "text": context})
    if language is not None:
        name = LANGUAGES.get(language.lower())
        if name is None:
            raise UsageError(
                f"language {language!r}: Fun-ASR-Nano's transcription prompt names zh, en or ja "
                "(leave language out for another: it transcribes the language it hears)"
            )
        content.append({"type": "language", "language": name})
    return render([{"role": "user", "content": content}], add_generation_prompt=True)
