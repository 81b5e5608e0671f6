"""Prompts with images, for GOT-OCR 2.0: each image resized bicubically to the tower's
square as GotOcr2ImageProcessor does (its Pillow backend, crop_to_patches off, the
processor's default), encoded (llmrun.models.got_ocr2_vision), and each image place
(<imgpad>, between <img> and </img>) repeated once per token, as GotOcr2Processor
expands it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.images import normalized
from llmrun.loading.got_ocr2_vision import GotOcr2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<imgpad>"


def image_tokens(vision: GotOcr2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes: the same for every image."""
    return vision.tokens


def pixel_values(vision: GotOcr2Vision, image) -> torch.Tensor:
    """Float32 pixels [3, size, size] of an RGB Pillow image."""
    from PIL import Image

    resized = image.resize((vision.size, vision.size), Image.Resampling.BICUBIC)
    return normalized(resized, vision.mean, vision.std)


@torch.inference_mode()
def encode(vision: GotOcr2Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [tokens, text hidden], encoded one at a time."""
    return [vision.encoder(pixel_values(vision, image)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <imgpad> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "GOT-OCR 2.0")
