"""Prompts with audio, for Granite Speech: each clip's features as
GraniteSpeechFeatureExtractor computes them, and each audio place (<|audio|>: Granite's
chat template reads a message's content as text, so a message's audio part is written as
<|audio|>, audio_families.written_places) expanded into as many <|audio|> as
GraniteSpeechProcessor gives the clip.

The feature extractor takes torchaudio's MelSpectrogram of the clip (a 400-sample periodic
Hann window centred in an FFT of 512, every 160 samples, the clip padded by reflection at
both ends; the power spectrum through an HTK mel bank from 0 Hz to 8 kHz without norm),
log10 of it (floored at 1e-10), floored again at the clip's maximum less 8, then
(x / 4 + 1); an odd last frame is dropped and each pair of frames stacked into one. Here
the same float32 torch operations compute it, which give its features exactly. The
processor counts (samples // 160 + 1) // 2 encoder frames and gives the clip
window_size // downsample_rate tokens per window_size of them begun. Each clip is
encoded alone (transformers pads a batch's clips to the longest, which gives a shorter
clip the encoding of its padding).

Granite Speech Plus takes its prompts and clips alike; its transcription request is the one
transformers documents for it (model_doc/granite_speech_plus: its SYSTEM_PROMPT, then
ASR_PROMPT as the user's turn, with the generation prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmrun import audio
from llmrun.errors import TokenizerError, UsageError
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

if TYPE_CHECKING:  # the loader imports FeatureSettings from here
    from llmrun.loading.granite_speech import GraniteSpeechAudio

AUDIO = "<|audio|>"
PLUS_SYSTEM = (
    "Knowledge Cutoff Date: April 2024.\nToday's Date: December 19, 2024.\n"
    "You are Granite, developed by IBM. You are a helpful AI assistant"
)
PLUS_INSTRUCTION = " can you transcribe the speech into a written format?"


@dataclass(frozen=True)
class FeatureSettings:
    """GraniteSpeechFeatureExtractor's mel settings (its defaults)."""

    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 80


def mel_filters(settings: FeatureSettings) -> torch.Tensor:
    """torchaudio's melscale_fbanks [n_fft // 2 + 1, n_mels] (HTK mels, no norm), in
    float32 as it computes them."""
    freqs = torch.linspace(0, audio.SAMPLE_RATE // 2, settings.n_fft // 2 + 1)
    top = 2595.0 * math.log10(1.0 + (audio.SAMPLE_RATE / 2) / 700.0)
    edges = 700.0 * (10.0 ** (torch.linspace(0.0, top, settings.n_mels + 2) / 2595.0) - 1.0)
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]
    down = (-1.0 * slopes[:, :-2]) / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return torch.max(torch.zeros(1), torch.min(down, up))


@torch.inference_mode()
def features(clip: audio.Clip, settings: FeatureSettings) -> torch.Tensor:
    """A clip's stacked log-mel features [frames // 2, 2 * n_mels] (float32), by the same
    float32 torch operations as torchaudio's MelSpectrogram and the extractor (numpy's
    float64 differs from them by up to 2e-5)."""
    n_fft = settings.n_fft
    if len(clip.samples) <= n_fft // 2:
        raise UsageError(f"{clip.name}: {len(clip.samples)} samples, too short for Granite Speech")
    wave = torch.from_numpy(np.ascontiguousarray(clip.samples, dtype=np.float32))[None]
    window = torch.hann_window(settings.win_length)
    spectrum = torch.stft(
        wave,
        n_fft,
        settings.hop_length,
        settings.win_length,
        window,
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )
    mel = (spectrum.abs().pow(2.0).transpose(-1, -2) @ mel_filters(settings))[0]
    logmel = mel.clip(min=1e-10).log10()
    logmel = torch.maximum(logmel, logmel.max() - 8.0) / 4 + 1
    if len(logmel) % 2:
        logmel = logmel[:-1]
    # [frames, n_mels] -> [frames // 2, 2 * n_mels]: each pair of frames side by side
    return logmel.reshape(-1, 2 * settings.n_mels)


def clip_tokens(encoder: GraniteSpeechAudio, clip: audio.Clip) -> int:
    """The <|audio|> tokens a clip takes, as GraniteSpeechProcessor counts them."""
    args = encoder.encoder.args
    frames = (len(clip.samples) // encoder.settings.hop_length + 1) // 2
    if len(clip.samples) <= encoder.settings.n_fft // 2 or frames == 0:
        raise UsageError(f"{clip.name}: {len(clip.samples)} samples, too short for Granite Speech")
    return -(-frames // args.window_size) * (args.window_size // args.downsample_rate)


@torch.inference_mode()
def encode(encoder: GraniteSpeechAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    out = []
    for clip in clips:
        clip_tokens(encoder, clip)
        out.append(encoder.encoder(features(clip, encoder.settings)))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|audio|> repeated for its clip's tokens, and where each
    clip's embeddings begin. The text must mark exactly one place per clip."""
    token = tokenizer.token_id(AUDIO)
    if token is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not Granite Speech's")
    places = text.count(AUDIO)
    if places != len(embeds):
        clips = len(embeds)
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({AUDIO}) for "
            f"{clips} clip{'s' * (clips != 1)}: write one {AUDIO} where each goes"
        )
    pieces = text.split(AUDIO)
    expanded = pieces[0] + "".join(
        AUDIO * len(e) + piece for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    # The clips' places may touch (the processor writes them as the text has them).
    places = [i for i, t in enumerate(ids) if t == token]
    starts, taken = [], 0
    for e in embeds:
        span = places[taken : taken + len(e)]
        if len(span) != len(e) or span[-1] - span[0] != len(e) - 1:
            raise TokenizerError(f"the tokenizer does not keep {AUDIO} whole")
        starts.append(span[0])
        taken += len(e)
    if taken != len(places):
        raise UsageError(f"the prompt's text holds {AUDIO} tokens of its own")
    return ids, PromptImages(list(embeds), starts)


def plus_transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """Granite Speech Plus's transcription prompt text: the chat template (`render`, asked
    for the generation prompt) of its system turn and a user turn of the clip and the
    instruction. A language is refused: the documented prompt names none."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not Granite Speech's")
    if language is not None:
        raise UsageError(
            f"language {language!r}: Granite Speech Plus's transcription prompt takes no "
            "language: leave language out"
        )
    messages = [
        {"role": "system", "content": PLUS_SYSTEM},
        {"role": "user", "content": AUDIO + PLUS_INSTRUCTION},
    ]
    return render(messages, add_generation_prompt=True)
