"""Images for TrOCR, which reads the text of one image and takes no prompt: the image resized
(and centre-cropped, for a DeiT's processor) and normalized as its image processor does (the
Pillow backend), encoded by its ViT or DeiT (llmrun.models.vit); the prompt is one
placeholder, the image: its encoder tokens are the decoder's source (llmrun.models.trocr),
which no position table bounds (trocr-base's 577 tokens outnumber its decoder's 512
positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmrun.errors import UsageError
from llmrun.images import normalized
from llmrun.loading.trocr_vision import TrOcrVision
from llmrun.multimodal import FramedImages
from llmrun.tokenizer import Tokenizer

PLACEHOLDER = 0  # never embedded: the image's tokens are the source


def image_tokens(vision: TrOcrVision, image: Any) -> int:
    """How many prompt tokens a (Pillow) image takes: its placeholder."""
    return 1


def pixel_values(vision: TrOcrVision, image: Any) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, as the processor makes them."""
    height, width = vision.size
    if image.size != (width, height):
        image = image.resize((width, height), vision.resample)
    if vision.crop is not None:
        crop_h, crop_w = vision.crop
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
    return normalized(image, vision.mean, vision.std)


@torch.inference_mode()
def encode(vision: TrOcrVision, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each (Pillow) image's encoder tokens [tokens, hidden_size]."""
    return [vision.encoder(pixel_values(vision, image)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], FramedImages]:
    """The prompt of the one image `encoded`, its placeholder; TrOCR takes no text."""
    if text:
        raise UsageError("TrOCR reads the text of an image and takes no prompt: give --image alone")
    if len(encoded) != 1:
        raise UsageError(f"TrOCR reads one image at a time, not {len(encoded)}")
    return [PLACEHOLDER], FramedImages(list(encoded), [0])
