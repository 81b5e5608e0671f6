"""Prompts with images, for Nemotron 3 Nano Omni: each image resized to a grid of patches
and cut into them as transformers' NemotronH_Omni_Reasoning_V3ImageProcessor does (its
get_patch_grid_size: about the image's own grid, scaled into the patch budget, both sides
rounded to whole 2x2 groups; resized bicubically with antialiasing on float pixels, so
the overshoot is kept; normalized), encoded (llmrun.models.nemotron_omni_vision), and
each image place that the chat template marks (<image>) expanded as its processor expands
it: <img>, one <image> per token, </img>. Images go to the language model in place of
their <image> tokens, seen causally as text is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from llmrun import multimodal
from llmrun.errors import TokenizerError
from llmrun.loading.nemotron_omni_vision import NemotronOmniVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE, IMAGE_START, IMAGE_END = "<image>", "<img>", "</img>"


def patch_grid(
    height: int, width: int, patch: int, merge: int, least: int, most: int
) -> tuple[int, int]:
    """The (rows, columns) of patches the processor resizes an image to (its
    get_patch_grid_size, for a budget of `least` to `most` patches)."""
    # round(x + 0.5): floor(x) + 1 for a fraction, x for a whole number.
    rows, columns = round(height / patch + 0.5), round(width / patch + 0.5)
    factor = min(math.sqrt(most / (rows * columns)), 1.0)
    rows, columns = math.floor(factor * rows), math.floor(factor * columns)
    if most > least and rows * columns < least:
        factor = math.sqrt(least / (rows * columns))
        rows, columns = math.ceil(factor * rows), math.ceil(factor * columns)
    if remainder := rows % merge:
        if (rows + merge - remainder) * columns <= most:
            rows += merge - remainder
        else:
            rows = max(merge, rows - remainder)
    if remainder := columns % merge:
        if rows * (columns + merge - remainder) <= most:
            columns += merge - remainder
        else:
            columns = max(merge, columns - remainder)
    return rows, columns


def _grid(vision: NemotronOmniVision, image) -> tuple[int, int]:
    return patch_grid(
        image.height,
        image.width,
        vision.patch_size,
        vision.merge_size,
        vision.min_patches,
        vision.max_patches,
    )


def image_tokens(vision: NemotronOmniVision, image) -> int:
    """How many <image> tokens a (Pillow) image takes, known before encoding it."""
    rows, columns = _grid(vision, image)
    return rows * columns // vision.merge_size**2


def pixel_patches(image, vision: NemotronOmniVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as the processor makes it: float32 patches [rows * columns,
    3 * patch²] row by row, each channel-major, and the grid of patches (rows, columns)."""
    patch = vision.patch_size
    rows, columns = _grid(vision, image)
    # [H, W, 3] uint8 -> [1, 3, H, W] float32
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1)[None].float()
    if (rows * patch, columns * patch) != (image.height, image.width):
        pixels = F.interpolate(
            pixels,
            size=[rows * patch, columns * patch],
            mode="bicubic",
            antialias=True,
            align_corners=False,
        )
    # Rescale and normalize fused, as the processor's torchvision backend does.
    mean = torch.tensor(vision.mean) * 255.0
    std = torch.tensor(vision.std) * 255.0
    pixels = (pixels[0] - mean[:, None, None]) / std[:, None, None]
    # [3, H, W] -> [rows, columns, 3, P, P]
    patches = pixels.view(3, rows, patch, columns, patch).permute(1, 3, 0, 2, 4)
    return patches.reshape(rows * columns, -1), rows, columns


@torch.inference_mode()
def encode(vision: NemotronOmniVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [tokens, hidden], encoded one at a time."""
    return [vision.encoder(*pixel_patches(image, vision)) for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> made <img>, one <image> per token of the image
    `encoded` (in order), </img>; and the images as generate() takes them."""
    missing = [t for t in (IMAGE_START, IMAGE_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(
            f"the tokenizer has no {', '.join(missing)}: not Nemotron 3 Nano Omni's"
        )
    framed = text.replace(IMAGE, IMAGE_START + IMAGE + IMAGE_END)
    return multimodal.pad_prompt(tokenizer, framed, encoded, IMAGE, "Nemotron 3 Nano Omni")
