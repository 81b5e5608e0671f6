"""Images for DeepSeek-VL 7B (deepseek_vl_hybrid), prepared as DeepseekVLHybridImageProcessor
does (its Pillow backend): resized and padded square for the SAM tower as JanusImageProcessor
would (llmrun.janus_images.squared), that square resized again for the SigLIP tower, each
normalized with its own mean and std; encoded (llmrun.models.deepseek_vl_hybrid_vision).
Prompts are DeepSeek-VL's (llmrun.deepseek_vl_images.prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun.images import normalized
from llmrun.janus_images import squared
from llmrun.loading.deepseek_vl_hybrid_vision import DeepseekVlHybridVision


def pixel_values(image, vision: DeepseekVlHybridVision) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 pixels of an RGB Pillow image for each tower: [3, s, s] and [3, S, S]."""
    high = squared(
        image, vision.high_size, vision.min_size, vision.high_resample, vision.high_background
    )
    low = squared(high, vision.image_size, vision.min_size, vision.resample, vision.background)
    return (
        normalized(low, vision.mean, vision.std),
        normalized(high, vision.high_mean, vision.high_std),
    )


def image_tokens(vision: DeepseekVlHybridVision, image) -> int:
    """How many prompt tokens an image takes: one per SigLIP patch."""
    return vision.encoder.args.tokens_per_image


@torch.inference_mode()
def encode(vision: DeepseekVlHybridVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [patches, hidden], encoded one at a time."""
    out = []
    for image in images:
        low, high = pixel_values(image, vision)
        out.append(vision.encoder(low[None], high[None])[0])
    return out
