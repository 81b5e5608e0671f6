"""Prompts with images, for LightOnOCR: each image resized as transformers'
PixtralImageProcessor does for it (llmrun.pixtral_images, in sides of the image
processor's patch size), encoded (llmrun.models.pixtral), and each image place that the
chat template marks (<|image_pad|>) expanded as LightOnOcrProcessor expands it: one
<|image_pad|> per merged token, row after row, with no break or end tokens between (the
processor names them but writes none). An image's embeddings take the place of its
tokens: one span per image, as llmrun.multimodal.PromptImages and the server's prefix
cache take them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.errors import UsageError
from llmrun.loading.lighton_ocr_vision import LightOnOcrVision
from llmrun.multimodal import PromptImages
from llmrun.pixtral_images import pixel_values, resized_size
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image_pad|>"


def grid(vision: LightOnOcrVision, image) -> tuple[int, int]:
    """The rows and columns of merged tokens a (Pillow) image takes: its resized sides
    over a merged token's, rounded down (LightOnOcrProcessor.replace_image_token)."""
    height, width = resized_size(image.height, image.width, vision.longest_edge, vision.unit)
    unit = vision.encoder.args.unit
    if height < unit or width < unit:
        raise UsageError(
            f"an image of {image.width}x{image.height} pixels is resized to {width}x{height}, "
            f"less than one token's {unit}x{unit}: too thin for LightOnOCR"
        )
    return height // unit, width // unit


def image_tokens(vision: LightOnOcrVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    rows, columns = grid(vision, image)
    return rows * columns


@torch.inference_mode()
def encode(vision: LightOnOcrVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    out = []
    for image in images:
        grid(vision, image)  # refuses an image too thin for a token
        pixels = pixel_values(image, vision.longest_edge, vision.unit, vision.mean, vision.std)
        out.append(vision.encoder(pixels).flatten(0, 1))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "LightOnOCR")
