"""Prompts with images and audio, for Gemma 4 Unified: Gemma 4's (gemma4_images,
gemma4_audio_clips, mixed_media.gemma4: the same chat template places and markers), but

- an image is cut into the embedder's patches (patch_size * pooling_kernel_size pixels
  square) after Gemma 4's resize: Gemma4UnifiedImageProcessor's 16-pixel patches merged
  3 x 3 are exactly these, in the same order, at (column, row);
- an image's tokens see each other both ways on every layer, beyond the sliding window
  too (transformers' Gemma4UnifiedModel ORs its image blocks into each layer's mask);
- a clip is its raw 16 kHz samples in frames of the embedder's width, the last one padded
  with zeros, one token each (Gemma4UnifiedAudioFeatureExtractor); its tokens attend
  causally, as Gemma 4's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmrun import audio, gemma4_audio_clips, gemma4_images, mixed_media
from llmrun.loading.gemma4_unified import Gemma4UnifiedAudio, Gemma4UnifiedVision
from llmrun.models.gemma3 import ImageTokens
from llmrun.models.gemma4 import GlobalBothWays
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


class UnifiedImageTokens(GlobalBothWays, ImageTokens):
    """An image's tokens seeing each other on every layer, whatever the window."""

    def unmask(self, frames: dict, window: int | None) -> dict:
        return super().unmask(frames, None)


class UnifiedMediaTokens(GlobalBothWays, mixed_media.MediaTokens):
    """Images' and clips' tokens: the images' seeing each other on every layer."""

    def unmask(self, frames: dict, window: int | None) -> dict:
        return ImageTokens(self.embeds, self.image_groups).unmask(frames, None)


class UnifiedPromptImages(PromptImages):
    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        tokens = super().tokens(begin, end, device)
        return None if tokens is None else UnifiedImageTokens(tokens.embeds, tokens.groups)


class UnifiedPromptMedia(mixed_media.PromptMedia):
    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        tokens = super().tokens(begin, end, device)
        if tokens is None:
            return None
        return UnifiedMediaTokens(tokens.embeds, tokens.groups, tokens.image_groups)


def image_tokens(vision: Gemma4UnifiedVision, image) -> int:
    """The soft tokens of an (RGB Pillow) image: its embedder patches once resized."""
    return gemma4_images.image_tokens(vision, image)


def encode(vision: Gemma4UnifiedVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tokens, text hidden]."""
    return gemma4_images.encode(vision, images)


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """gemma4_images.prompt, the images seen both ways on every layer."""
    ids, images = gemma4_images.prompt(tokenizer, text, embeds)
    return ids, UnifiedPromptImages(images.embeds, images.starts)


def frames(encoder: Gemma4UnifiedAudio, clip: audio.Clip) -> np.ndarray:
    """A clip's samples [tokens, samples a frame], the last frame padded with zeros."""
    width = encoder.samples
    samples = clip.samples.astype(np.float32)
    padded = np.pad(samples, (0, -len(samples) % width))
    return padded.reshape(-1, width)


def clip_tokens(encoder: Gemma4UnifiedAudio, clip: audio.Clip) -> int:
    """The <|audio|> tokens a clip takes: one a frame, as Gemma4UnifiedProcessor counts."""
    return -(-len(clip.samples) // encoder.samples)


@torch.inference_mode()
def encode_clips(encoder: Gemma4UnifiedAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's soft tokens [tokens, text hidden]."""
    return [encoder.encoder(torch.from_numpy(frames(encoder, clip))) for clip in clips]


def clip_prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """gemma4_audio_clips.prompt: Gemma 4's places, the clips attending causally."""
    return gemma4_audio_clips.prompt(tokenizer, text, embeds)


def with_images(
    tokenizer: Tokenizer,
    text: str,
    images: Sequence[torch.Tensor],
    clips: Sequence[torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """mixed_media.gemma4, the images seen both ways on every layer."""
    ids, media = mixed_media.gemma4(tokenizer, text, images, clips)
    return ids, UnifiedPromptMedia(media.embeds, media.starts, media.clips)
