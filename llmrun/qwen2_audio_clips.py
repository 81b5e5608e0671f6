"""Prompts with audio, for Qwen2-Audio: each audio place the chat template marks (one
<|AUDIO|>, between <|audio_bos|> and <|audio_eos|>) expanded into as many <|AUDIO|> as
Qwen2AudioProcessor gives the clip, and the clips encoded; where their embeddings go is a
multimodal.PromptImages, which the prefill places as it places images.

The processor pads a clip to 30 seconds (and cuts what is longer: llmrun refuses such a
clip instead) and counts its feature frames as the audio reaches them, one per 10 ms
begun; the encoder's convolutions halve them and its pool halves them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import audio
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.qwen2_audio import Qwen2Audio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<|AUDIO|>"


def _frames(encoder: Qwen2Audio, clip: audio.Clip) -> int:
    """The feature frames a clip's audio reaches (the processor's feature_attention_mask
    sum); a clip longer than a chunk, or too short for one token, is refused."""
    samples, chunk_frames = len(clip.samples), encoder.encoder.args.chunk_frames
    chunk = chunk_frames * audio.HOP_LENGTH
    if samples > chunk:
        raise UsageError(
            f"{clip.name}: {samples / audio.SAMPLE_RATE:.1f} seconds of audio; Qwen2-Audio "
            f"takes {chunk // audio.SAMPLE_RATE} seconds a clip at most (cut it into clips)"
        )
    frames = -(-samples // audio.HOP_LENGTH)
    if frames < 3:  # fewer make no token
        raise UsageError(f"{clip.name}: {samples} samples, too short for Qwen2-Audio")
    return frames


def clip_tokens(encoder: Qwen2Audio, clip: audio.Clip) -> int:
    """The <|AUDIO|> tokens a clip takes, as Qwen2AudioProcessor counts them."""
    positions = (_frames(encoder, clip) - 1) // 2 + 1
    return positions // 2


@torch.inference_mode()
def encode(encoder: Qwen2Audio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    args = encoder.encoder.args
    seconds = args.chunk_frames * audio.HOP_LENGTH // audio.SAMPLE_RATE
    out = []
    for clip in clips:
        frames = _frames(encoder, clip)
        features = torch.from_numpy(audio.chunked_features(clip, args.num_mel_bins, seconds))
        out.append(encoder.encoder(features, frames))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor], pad: str = AUDIO
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each audio pad (`pad`: <|AUDIO|>, or Qwen3-Omni's
    <|audio_pad|>) repeated for its clip's tokens, and where each clip's embeddings begin.
    The text must mark exactly one place per clip."""
    token = tokenizer.token_id(pad)
    if token is None:
        raise TokenizerError(f"the tokenizer has no {pad}: not the audio model's")
    places = text.count(pad)
    if places != len(embeds):
        clips = len(embeds)
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({pad}) for "
            f"{clips} clip{'s' * (clips != 1)}: write one {pad} where each goes"
        )
    pieces = text.split(pad)
    expanded = pieces[0] + "".join(
        pad * len(e) + piece for e, piece in zip(embeds, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    runs = [
        (i, next((k for k in range(i, len(ids)) if ids[k] != token), len(ids)) - i)
        for i, t in enumerate(ids)
        if t == token and (i == 0 or ids[i - 1] != token)
    ]
    if [length for _, length in runs] != [len(e) for e in embeds]:
        raise UsageError(f"the prompt's {pad} places are not apart: write text between them")
    return ids, PromptImages(list(embeds), [start for start, _ in runs])
