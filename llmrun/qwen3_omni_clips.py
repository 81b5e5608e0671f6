"""Prompts with audio, for Qwen3-Omni: each audio place the chat template marks (one
<|audio_pad|>, between <|audio_start|> and <|audio_end|>) expanded into as many
<|audio_pad|> as Qwen3OmniMoeProcessor gives the clip, the clips encoded, and every token's
M-RoPE positions as get_rope_index gives a prompt of audio without images or video: each
token one position on all three axes (an audio token's positions run on as text's do).

A clip's features are those WhisperFeatureExtractor gives it alone (padding "longest",
no truncation): one frame per 10 ms whole, the spectrogram over the clip itself (reflected
at its ends). Given several clips at once the processor zero-pads the shorter ones to the
longest and counts one frame per 10 ms begun; llmrun encodes each clip on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import UsageError
from llmrun.loading.qwen3_omni import Qwen3OmniAudio
from llmrun.models import qwen3_omni_audio
from llmrun.qwen2_vl_images import QwenPromptImages, rope_index
from llmrun.tokenizer import Tokenizer

AUDIO_PAD = "<|audio_pad|>"


def _frames(clip: audio.Clip) -> int:
    """The feature frames of a clip; one too short for the spectrogram's window is
    refused."""
    samples = len(clip.samples)
    if samples <= audio.N_FFT // 2:
        raise UsageError(f"{clip.name}: {samples} samples, too short for Qwen3-Omni")
    return samples // audio.HOP_LENGTH


def clip_tokens(encoder: Qwen3OmniAudio, clip: audio.Clip) -> int:
    """The <|audio_pad|> tokens a clip takes, as Qwen3OmniMoeProcessor counts them."""
    return qwen3_omni_audio.clip_tokens(encoder.encoder.args, _frames(clip))


@torch.inference_mode()
def encode(encoder: Qwen3OmniAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    mel_bins = encoder.encoder.args.num_mel_bins
    out = []
    for clip in clips:
        _frames(clip)
        features = audio.log_mel(clip.samples, mel_bins)
        out.append(encoder.encoder(torch.from_numpy(features)))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|audio_pad|> repeated for its clip's tokens, and the
    clips as generate() takes them (with every token's M-RoPE positions). The text must
    mark exactly one place per clip."""
    ids, clips = qwen2_audio_clips.prompt(tokenizer, text, embeds, AUDIO_PAD)
    return ids, QwenPromptImages(clips.embeds, clips.starts, rope_index(len(ids), [], []))
