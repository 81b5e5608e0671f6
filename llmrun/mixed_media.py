"""Prompts with images and audio together, for the families whose processors take both in
one message (Gemma4Processor, Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor,
NemotronH_Omni_Reasoning_V3Processor): the text's
audio places expanded for their clips first, then the family's own image prompt over it
(an audio token is text to it), then the clips' tokens found in its ids; one PromptImages
holds both in prompt order.

An audio token's positions are a text token's there: get_rope_index gives each one
position on all three M-RoPE axes after whatever came before it (so the image prompt's
positions stand), and Gemma 4's are plain. What differs is attention: Gemma 4's image
tokens see each other both ways on its sliding layers, a clip's attend causally
(gemma4_audio_clips).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun import (
    gemma4_audio_clips,
    gemma4_images,
    nemotron_omni_clips,
    nemotron_omni_images,
    qwen2_vl_images,
    qwen3_omni_clips,
)
from llmrun.errors import TokenizerError, UsageError
from llmrun.models.gemma3 import ImageTokens
from llmrun.multimodal import PromptImages
from llmrun.qwen2_audio_clips import AUDIO as OMNI_AUDIO
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer


def _audio_expanded(
    text: str, place: str, clips: Sequence[torch.Tensor], written: Callable[[int], str]
) -> str:
    """`text` with each audio `place` written as `written` gives a clip of that many
    tokens; the text must mark exactly one place per clip."""
    pieces = text.split(place)
    places = len(pieces) - 1
    if places != len(clips):
        raise UsageError(
            f"the prompt marks {places} audio place{'s' * (places != 1)} ({place}) for "
            f"{len(clips)} clip{'s' * (len(clips) != 1)}: write one {place} where each goes"
        )
    return pieces[0] + "".join(
        written(len(clip)) + piece for clip, piece in zip(clips, pieces[1:], strict=True)
    )


def _clip_starts(
    ids: list[int], token: int, place: str, clips: Sequence[torch.Tensor]
) -> list[int]:
    """Where each clip's run of `token` begins in `ids`, each run as long as its clip."""
    runs = [
        (i, next((k for k in range(i, len(ids)) if ids[k] != token), len(ids)) - i)
        for i, t in enumerate(ids)
        if t == token and (i == 0 or ids[i - 1] != token)
    ]
    if [length for _, length in runs] != [len(clip) for clip in clips]:
        raise UsageError(f"the prompt's {place} places are not apart: write text between them")
    return [start for start, _ in runs]


def _in_order(
    images: PromptImages, clips: Sequence[torch.Tensor], clip_starts: Sequence[int]
) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    """The images' and clips' embeddings and starts in prompt order, and which are clips."""
    items = sorted(
        [(s, e, False) for s, e in zip(images.starts, images.embeds, strict=True)]
        + [(s, e, True) for s, e in zip(clip_starts, clips, strict=True)],
        key=lambda item: item[0],
    )
    return [e for _, e, _ in items], [s for s, _, _ in items], [c for _, _, c in items]


def _qwen(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
    markers: tuple[str, str, str],
    family: str,
    pad: str,
) -> tuple[list[int], QwenPromptImages]:
    token = tokenizer.token_id(pad)
    if token is None:
        raise TokenizerError(f"the tokenizer has no {pad}: not {family}'s")
    expanded = _audio_expanded(text, pad, clips, lambda tokens: pad * tokens)
    ids, pictures = qwen2_vl_images.prompt(tokenizer, expanded, images, markers, family)
    starts = _clip_starts(ids, token, pad, clips)
    # Image tokens may carry deepstack features after them (Qwen3-Omni's); a clip's add
    # none, as transformers adds them at image tokens only.
    width = pictures.embeds[0].shape[-1]
    padded = [F.pad(clip, (0, width - clip.shape[-1])) for clip in clips]
    embeds, begins, _ = _in_order(pictures, padded, starts)
    return ids, QwenPromptImages(embeds, begins, pictures.rope)


def qwen2_5_omni(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with its <|IMAGE|> and <|AUDIO|> places expanded for the encoded
    `images` (qwen2_vl_images.encode) and `clips`, each kind in order, and both as
    generate() takes them, with every token's M-RoPE positions."""
    markers = qwen2_vl_images.OMNI_MARKERS
    return _qwen(tokenizer, text, images, clips, markers, "Qwen2.5-Omni", OMNI_AUDIO)


def qwen3_omni(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
) -> tuple[list[int], QwenPromptImages]:
    """qwen2_5_omni for Qwen3-Omni's <|image_pad|> and <|audio_pad|> places."""
    markers = (qwen2_vl_images.VISION_START, qwen2_vl_images.IMAGE_PAD, qwen2_vl_images.VISION_END)
    return _qwen(tokenizer, text, images, clips, markers, "Qwen3-Omni", qwen3_omni_clips.AUDIO_PAD)


@dataclass
class MediaTokens(ImageTokens):
    """A forward's image and clip soft tokens, placed alike; `image_groups` [T] is
    `groups` at image tokens, -1 elsewhere: only an image's tokens see each other both
    ways."""

    image_groups: torch.Tensor

    def unmask(self, frames: dict, window: int | None) -> dict:
        return ImageTokens(self.embeds, self.image_groups).unmask(frames, window)


@dataclass
class PromptMedia(PromptImages):
    """A Gemma 4 prompt's images and clips in order; `clips` says which are clips."""

    clips: list[bool]

    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        tokens = super().tokens(begin, end, device)
        if tokens is None:
            return None
        clip_groups = torch.tensor([i for i, clip in enumerate(self.clips) if clip], device=device)
        image_groups = tokens.groups.masked_fill(torch.isin(tokens.groups, clip_groups), -1)
        return MediaTokens(tokens.embeds, tokens.groups, image_groups)


def gemma4(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
) -> tuple[list[int], PromptMedia]:
    """The ids of `text` with its <|image|> and <|audio|> places expanded for the encoded
    `images` and `clips`, each kind in order, between their begin and end markers, and
    both as generate() takes them."""
    begin, soft, end = (
        gemma4_audio_clips.AUDIO_BEGIN,
        gemma4_audio_clips.AUDIO_SOFT,
        gemma4_audio_clips.AUDIO_END,
    )
    missing = [t for t in (begin, soft, end) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Gemma 4's")
    expanded = _audio_expanded(text, soft, clips, lambda tokens: f"{begin}{soft * tokens}{end}")
    ids, pictures = gemma4_images.prompt(tokenizer, expanded, images)
    starts = _clip_starts(ids, tokenizer.token_id(soft), soft, clips)
    embeds, begins, are_clips = _in_order(pictures, clips, starts)
    return ids, PromptMedia(embeds, begins, are_clips)


def nemotron_omni(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with its <image> and <so_embedding> places expanded for the
    encoded `images` and `clips`, each kind in order, between their begin and end markers,
    and both as generate() takes them (all seen causally, as text is)."""
    begin, soft, end = (
        nemotron_omni_clips.AUDIO_START,
        nemotron_omni_clips.AUDIO,
        nemotron_omni_clips.AUDIO_END,
    )
    missing = [t for t in (begin, soft, end) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(
            f"the tokenizer has no {', '.join(missing)}: not Nemotron 3 Nano Omni's"
        )
    expanded = _audio_expanded(text, soft, clips, lambda tokens: f"{begin}{soft * tokens}{end}")
    ids, pictures = nemotron_omni_images.prompt(tokenizer, expanded, images)
    starts = _clip_starts(ids, tokenizer.token_id(soft), soft, clips)
    embeds, begins, _ = _in_order(pictures, clips, starts)
    return ids, PromptImages(embeds, begins)
