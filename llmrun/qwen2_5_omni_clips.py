"""Prompts with audio, for Qwen2.5-Omni: each audio place the chat template marks (one
<|AUDIO|>, between <|audio_bos|> and <|audio_eos|>) expanded into as many <|AUDIO|> as
Qwen2_5OmniProcessor gives the clip (as llmrun.qwen2_audio_clips does for Qwen2-Audio),
the clips encoded, and every token's M-RoPE positions as get_rope_index gives a prompt of
audio without images or video: each token one position on all three axes (TMRoPE times
an audio token at 40 ms, one position, so its positions run on as text's do).

The processor takes the features of the clip's own frames (one per 10 ms begun) out of a
spectrogram over the clip zero-padded to its chunk_length (300 seconds on the Hub; it cuts
a longer clip, which llmrun refuses): the frames past the clip's end add nothing to the
spectrogram's maximum, so llmrun pads one second, which covers every window its frames
reach.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import UsageError
from llmrun.loading.qwen2_5_omni import Qwen25OmniAudio
from llmrun.qwen2_vl_images import QwenPromptImages, rope_index
from llmrun.tokenizer import Tokenizer


def _frames(encoder: Qwen25OmniAudio, clip: audio.Clip) -> int:
    """The feature frames a clip's audio reaches; a clip too long, or too short for one
    token, is refused."""
    samples = len(clip.samples)
    if samples > encoder.max_seconds * audio.SAMPLE_RATE:
        raise UsageError(
            f"{clip.name}: {samples / audio.SAMPLE_RATE:.1f} seconds of audio; Qwen2.5-Omni "
            f"takes {encoder.max_seconds} seconds a clip at most (cut it into clips)"
        )
    frames = -(-samples // audio.HOP_LENGTH)
    if frames < 3:  # fewer make no token
        raise UsageError(f"{clip.name}: {samples} samples, too short for Qwen2.5-Omni")
    return frames


def clip_tokens(encoder: Qwen25OmniAudio, clip: audio.Clip) -> int:
    """The <|AUDIO|> tokens a clip takes, as Qwen2_5OmniProcessor counts them."""
    return ((_frames(encoder, clip) - 1) // 2 + 1) // 2


@torch.inference_mode()
def encode(encoder: Qwen25OmniAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    mel_bins = encoder.encoder.args.num_mel_bins
    out = []
    for clip in clips:
        frames = _frames(encoder, clip)
        padded = np.zeros(len(clip.samples) + audio.SAMPLE_RATE, dtype=np.float32)
        padded[: len(clip.samples)] = clip.samples
        features = audio.log_mel(padded, mel_bins)[:, :frames]
        out.append(encoder.encoder(torch.from_numpy(np.ascontiguousarray(features))))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|AUDIO|> repeated for its clip's tokens, and the clips
    as generate() takes them (with every token's M-RoPE positions). The text must mark
    exactly one place per clip."""
    ids, clips = qwen2_audio_clips.prompt(tokenizer, text, embeds)
    return ids, QwenPromptImages(clips.embeds, clips.starts, rope_index(len(ids), [], []))
