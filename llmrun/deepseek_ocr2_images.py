"""Prompts with images, for DeepSeek-OCR 2: each image prepared as transformers'
DeepseekOcr2ImageProcessor does (its Pillow backend): where its longer side is over a
crop's, the image resized bicubically onto the grid of 2 to 6 crops whose aspect is
nearest its own (GotOcr2's choice, llmrun.internvl_images.tile_grid) and cut row by row;
and the whole image resized bicubically to fit the global size, centred on a square of the
background colour. Each view is encoded (llmrun.models.deepseek_ocr2_vision); an image's
tokens are its crops', the whole image's, then the learned view separator, each in the
place of one <image> token: DeepseekOcr2Processor repeats each <image> of the text for
all of them, with no other tokens between.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.errors import UsageError
from llmrun.images import normalized
from llmrun.internvl_images import tile_grid
from llmrun.loading.deepseek_ocr2_vision import DeepseekOcr2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<image>"


def crop_grid(vision: DeepseekOcr2Vision, image) -> tuple[int, int]:
    """The (columns, rows) of crops an image is cut into; (0, 0) where it takes none."""
    if max(image.width, image.height) <= vision.tile:
        return 0, 0
    return tile_grid(image.height, image.width, vision.tile, vision.min_crops, vision.max_crops)


def whole_size(vision: DeepseekOcr2Vision, image) -> tuple[int, int]:
    """The (width, height) the whole image is resized to: its longer side to the global
    size, the other in proportion, rounded."""
    scale = vision.size / max(image.width, image.height)
    width, height = round(image.width * scale), round(image.height * scale)
    if not (width and height):
        raise UsageError(
            f"an image of {image.width}x{image.height} pixels is resized to {width}x{height}: "
            "too thin for DeepSeek-OCR 2"
        )
    return width, height


def image_tokens(vision: DeepseekOcr2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    whole_size(vision, image)  # refuses an image too thin for its whole view
    columns, rows = crop_grid(vision, image)
    return columns * rows * vision.crop_tokens + vision.global_tokens + 1


def views(vision: DeepseekOcr2Vision, image) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Float32 pixels of an RGB Pillow image's crops [n, 3, tile, tile] (None where it takes
    none) and of its whole view [3, size, size]: / 255, then (x - mean) / std."""
    from PIL import Image

    bicubic = Image.Resampling.BICUBIC
    columns, rows = crop_grid(vision, image)
    crops = None
    if columns:
        tile = vision.tile
        resized = image.resize((tile * columns, tile * rows), bicubic)
        crops = torch.stack(
            [
                normalized(
                    resized.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)),
                    vision.mean,
                    vision.std,
                )
                for r in range(rows)
                for c in range(columns)
            ]
        )
    width, height = whole_size(vision, image)
    side = max(width, height)
    square = Image.new("RGB", (side, side), vision.background)
    square.paste(
        image.resize((width, height), bicubic), ((side - width) // 2, (side - height) // 2)
    )
    return crops, normalized(square, vision.mean, vision.std)


@torch.inference_mode()
def encode(vision: DeepseekOcr2Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [crops' + the whole view's + 1, text hidden], encoded
    one image at a time."""
    out = []
    encoder = vision.encoder
    for image in images:
        crops, whole = views(vision, image)
        parts = [] if crops is None else [encoder(crops).flatten(0, 1)]
        parts += [encoder(whole[None])[0], encoder.view_seperator[None]]
        out.append(torch.cat(parts))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "DeepSeek-OCR 2")
