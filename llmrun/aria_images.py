"""Prompts with images, for Aria: each image prepared as transformers' AriaImageProcessor
does (its Pillow backend), encoded (llmrun.models.aria_vision), and each image place that
the chat template marks (<|img|>) repeated once per soft token, as AriaProcessor expands
it.

AriaImageProcessor: the whole image, or with split_image the tiles of the split resolution
that keeps most of it (LLaVA-NeXT's choice, fitting and black centred padding:
llmrun.llava_images), each tile max_image_size pixels square. Each such crop is resized so
that its longer side is max_image_size and its shorter side at least min_image_size,
padded with black below and right to the square, normalized. Only the patches with a real
pixel are encoded (the rest are masked out in transformers).

AriaProcessor gives every image of a batch the crop count of the image with the most; here
each image takes its own (the same for one image, or for images alike).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.images import normalized
from llmrun.llava_images import best_resolution, fitted_size
from llmrun.loading.aria_vision import AriaVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|img|>"


def crops(vision: AriaVision, image) -> list:
    """The Pillow crops of an RGB image, before resizing: the image, or its tiles row by
    row."""
    from PIL import Image

    if not vision.splitting:
        return [image]
    best = best_resolution(image.height, image.width, vision.split_resolutions)
    height, width = fitted_size(image.height, image.width, best)
    canvas = Image.new("RGB", (best[1], best[0]), (0, 0, 0))
    resized = image.resize((width, height), vision.resample)
    canvas.paste(resized, ((best[1] - width) // 2, (best[0] - height) // 2))
    side = vision.max_image_size
    return [
        canvas.crop((x, y, min(x + side, best[1]), min(y + side, best[0])))
        for y in range(0, best[0], side)
        for x in range(0, best[1], side)
    ]


def resized_size(height: int, width: int, longest: int, shortest: int) -> tuple[int, int]:
    """The (height, width) AriaImageProcessor resizes a crop to."""
    scale = longest / max(height, width)
    if width >= height:
        return max(int(height * scale), shortest), longest
    return longest, max(int(width * scale), shortest)


def pixel_values(vision: AriaVision, image) -> list[torch.Tensor]:
    """Float32 pixels [3, rows * patch, columns * patch] of each crop of an RGB Pillow
    image: the patches of its max_image_size square that hold a real pixel."""
    square, patch = vision.max_image_size, vision.encoder.args.vision.patch_size
    out = []
    for crop in crops(vision, image):
        height, width = resized_size(crop.height, crop.width, square, vision.min_image_size)
        pixels = normalized(crop.resize((width, height), vision.resample), vision.mean, vision.std)
        # The padding's black, normalized as the processor normalizes it.
        padded = normalized_black(vision).expand(3, square, square).clone()
        padded[:, :height, :width] = pixels
        rows, columns = math.ceil(height / patch), math.ceil(width / patch)
        out.append(padded[:, : rows * patch, : columns * patch])
    return out


def normalized_black(vision: AriaVision) -> torch.Tensor:
    """A black pixel [3, 1, 1] after normalization."""
    mean, std = (torch.tensor(v, dtype=torch.float64) for v in (vision.mean, vision.std))
    return ((0 - mean) / std).float()[:, None, None]


@torch.inference_mode()
def encode(vision: AriaVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [crops * queries, hidden], each crop encoded
    alone."""
    square = vision.max_image_size
    return [
        torch.cat([vision.encoder(p[None], square)[0] for p in pixel_values(vision, image)])
        for image in images
    ]


def image_tokens(vision: AriaVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    count = 1
    if vision.splitting:
        best = best_resolution(image.height, image.width, vision.split_resolutions)
        count = math.ceil(best[0] / vision.max_image_size) * math.ceil(
            best[1] / vision.max_image_size
        )
    return count * vision.tokens_per_crop


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|img|> repeated for the image `encoded` in order, and
    the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "Aria")
