"""Prompts with images, for Phi-4-multimodal: each image laid on an HD canvas of crops as
transformers' Phi4MultimodalImageProcessor does (a grid of crop_size squares that holds
it, or past dynamic_hd crops the grid of the nearest aspect; the image resized to fill
the grid's width or height and padded white to the rest), the global view (the canvas
resized to one crop), encoded (llmrun.models.phi4mm_vision), and each image place the
chat template marks (the image token) repeated once per soft token, as
Phi4MultimodalProcessor does.

Resizing the image is on its uint8 pixels, bilinear and antialiased (torch's, which the
processor's torchvision backend calls); normalizing is its fused (x - 255 mean) /
(255 std) in float32; the global view is a bicubic resize of the normalized canvas,
without antialiasing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmrun import multimodal
from llmrun.errors import UsageError
from llmrun.loading.phi4mm_vision import Phi4mmVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


@dataclass(frozen=True)
class Layout:
    """An image's canvas: columns x rows crops, the size the image is resized to and the
    white padding right and below it."""

    columns: int
    rows: int
    width: int
    height: int
    pad_width: int
    pad_height: int


@lru_cache(maxsize=16)
def _grids(max_crops: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) of at most max_crops crops, fewest first (the processor's
    sorted set; ties in its order do not change the choice below)."""
    grids = {(i, j) for i in range(1, max_crops + 1) for j in range(1, max_crops + 1)}
    return tuple(sorted((g for g in grids if g[0] * g[1] <= max_crops), key=lambda g: g[0] * g[1]))


def _nearest_aspect(width: int, height: int, crop: int, max_crops: int) -> tuple[int, int]:
    """find_closest_aspect_ratio: the grid whose aspect is nearest the image's; among
    equals, a later one where the image covers over half of its area."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for columns, rows in _grids(max_crops):
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and width * height > 0.5 * crop * crop * columns * rows:
            best = (columns, rows)
    return best


def layout(height: int, width: int, crop: int, max_crops: int) -> Layout:
    """The canvas of an image of height x width (the processor's _get_crop_layout)."""
    columns, rows = math.ceil(width / crop), math.ceil(height / crop)
    if columns * rows > max_crops:
        columns, rows = _nearest_aspect(width, height, crop, max_crops)
    target_width, target_height = crop * columns, crop * rows
    if target_width / width < target_height / height:
        new = (target_width, int(height * (target_width / width)))
    else:
        new = (int(width * (target_height / height)), target_height)
    if min(new[1], target_height) < 10 or min(new[0], target_width) < 10:
        raise UsageError(f"an image of {width}x{height} is too narrow for Phi-4-multimodal")
    return Layout(columns, rows, *new, target_width - new[0], target_height - new[1])


def crop_masks(vision: Phi4mmVision, canvas: Layout) -> torch.Tensor:
    """The valid patches [1 + crops, patches, patches] of the global view (all) and of
    each crop row by row: those of whole patches of the resized image."""
    side = vision.crop // vision.patch
    mask = torch.ones(side * canvas.rows, side * canvas.columns)
    if canvas.pad_width >= vision.patch:
        mask[:, -(canvas.pad_width // vision.patch) :] = 0
    if canvas.pad_height >= vision.patch:
        mask[-(canvas.pad_height // vision.patch) :, :] = 0
    # [rows * side, columns * side] -> [rows * columns, side, side]
    crops = mask.view(canvas.rows, side, canvas.columns, side).transpose(1, 2).flatten(0, 1)
    return torch.cat([torch.ones(1, side, side), crops])


def image_tokens(vision: Phi4mmVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes (the processor's
    _get_num_image_tokens): the valid canvas's soft tokens and a separator a row, one
    token, and the global view's, each row with its separator."""
    canvas = layout(image.height, image.width, vision.crop, vision.max_crops)
    masks = crop_masks(vision, canvas)[1:, ::2, ::2]
    side = masks.shape[-1]
    kept = masks.view(canvas.rows, canvas.columns, side, side).transpose(1, 2)
    kept = kept.reshape(canvas.rows * side, canvas.columns * side)
    height, width = int(kept[:, 0].sum()), int(kept[0, :].sum())
    return height * (width + 1) + 1 + side * (side + 1)


def pixel_values(vision: Phi4mmVision, image) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """Float32 crops [1 + crops, 3, crop, crop] of an RGB Pillow image (the global view
    first, then the canvas's row by row), their patch masks and the canvas."""
    canvas = layout(image.height, image.width, vision.crop, vision.max_crops)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    resized = F.interpolate(
        pixels, size=(canvas.height, canvas.width), mode="bilinear", antialias=True
    )
    padded = F.pad(resized, (0, canvas.pad_width, 0, canvas.pad_height), value=255)
    mean = torch.tensor([m / (1 / 255) for m in vision.mean], dtype=torch.float32)[:, None, None]
    std = torch.tensor([s / (1 / 255) for s in vision.std], dtype=torch.float32)[:, None, None]
    normalized = (padded[0].float() - mean) / std
    size = vision.crop
    whole = F.interpolate(normalized[None], size=(size, size), mode="bicubic", antialias=False)
    # [3, rows * crop, columns * crop] -> [rows * columns, 3, crop, crop]
    crops = normalized.view(3, canvas.rows, size, canvas.columns, size).permute(1, 3, 0, 2, 4)
    crops = crops.reshape(-1, 3, size, size)
    return torch.cat([whole, crops]), crop_masks(vision, canvas), canvas


@torch.inference_mode()
def encode(vision: Phi4mmVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tokens, hidden], one image at a time."""
    out = []
    for image in images:
        crops, masks, canvas = pixel_values(vision, image)
        out.append(vision.encoder(crops, masks, canvas.rows, canvas.columns))
    return out


def prompt(
    vision: Phi4mmVision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each image token (the config's image_token_id, as the
    tokenizer spells it) repeated once per soft token of its image, in order."""
    pad = tokenizer.token_to_piece(vision.image_token_id)
    return multimodal.pad_prompt(tokenizer, text, encoded, pad, "Phi-4-multimodal")
