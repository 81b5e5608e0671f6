"""Prompts with images, for Muse Glimmer: each image resized and cut into patches as
transformers' MuseGlimmerImageProcessor does (its torchvision backend: a grid of merged
patches nearest the image's aspect ratio under max_image_tokens, resized with torch's
antialiased Lanczos on the uint8 pixels, normalized), encoded
(llmrun.models.muse_glimmer_vision), and each image place that the chat template marks
(<|patch|>) expanded as MuseGlimmerProcessor expands it: <|image_start|>, one <|patch|> per
merged token, <|image_end|>. Images go to the language model in place of their
<|patch|> tokens, seen causally as text is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from llmrun import multimodal
from llmrun.errors import TokenizerError
from llmrun.loading.muse_glimmer_vision import MuseGlimmerVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

PATCH, IMAGE_START, IMAGE_END = "<|patch|>", "<|image_start|>", "<|image_end|>"


def smart_resize(height: int, width: int, unit: int, max_tokens: int) -> tuple[int, int]:
    """The (height, width) in pixels MuseGlimmerImageProcessor resizes to: of the grids of
    `unit`-pixel tokens around the image's (scaled down to `max_tokens` if it holds more),
    at most max_tokens, the one whose aspect ratio is nearest the image's (its smart_resize,
    candidates in its order)."""
    ideal_h, ideal_w = height / unit, width / unit
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > max_tokens:
        ideal_h = (max_tokens / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    rows = [math.floor(ideal_h), math.ceil(ideal_h)]
    columns = [math.floor(ideal_w), math.ceil(ideal_w)]
    candidates = [
        (h, w)
        for h, w in list(set(itertools.product(rows, columns)))
        if h >= 1 and w >= 1 and h * w <= max_tokens
    ]
    if not candidates:
        candidates = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    best_h, best_w = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return best_h * unit, best_w * unit


def _unit(vision: MuseGlimmerVision) -> int:
    args = vision.encoder.args
    return args.patch_size * args.merge_size


def image_tokens(vision: MuseGlimmerVision, image) -> int:
    """How many <|patch|> tokens a (Pillow) image takes, known before encoding it."""
    unit = _unit(vision)
    height, width = smart_resize(image.height, image.width, unit, vision.max_tokens)
    return (height // unit) * (width // unit)


def pixel_patches(image, vision: MuseGlimmerVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as MuseGlimmerImageProcessor makes it: float32 patches
    [grid_h * grid_w, 3 * patch²] row by row (one temporal slab: the processor repeats it),
    and the grid of patches (h, w)."""
    patch = vision.encoder.args.patch_size
    height, width = smart_resize(image.height, image.width, _unit(vision), vision.max_tokens)
    # [H, W, 3] uint8 -> [1, 3, H, W]
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1)[None].contiguous()
    if (height, width) != (image.height, image.width):  # torchvision leaves the size as is
        pixels = F.interpolate(
            pixels, size=[height, width], mode="lanczos", antialias=True, align_corners=False
        )
    # Rescale and normalize fused, as the processor's torchvision backend does.
    mean = torch.tensor(vision.mean) * 255.0
    std = torch.tensor(vision.std) * 255.0
    pixels = (pixels[0].float() - mean[:, None, None]) / std[:, None, None]
    grid_h, grid_w = height // patch, width // patch
    # [3, H, W] -> [h, w, 3, P, P]
    patches = pixels.view(3, grid_h, patch, grid_w, patch).permute(1, 3, 0, 2, 4)
    return patches.reshape(grid_h * grid_w, -1), grid_h, grid_w


@torch.inference_mode()
def encode(vision: MuseGlimmerVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [tokens, hidden], encoded one at a time."""
    return [vision.encoder(*pixel_patches(image, vision)) for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|patch|> made <|image_start|>, one <|patch|> per token
    of the image `encoded` (in order), <|image_end|>; and the images as generate() takes
    them."""
    missing = [t for t in (IMAGE_START, IMAGE_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Muse Glimmer's")
    framed = text.replace(PATCH, IMAGE_START + PATCH + IMAGE_END)
    return multimodal.pad_prompt(tokenizer, framed, encoded, PATCH, "Muse Glimmer")
