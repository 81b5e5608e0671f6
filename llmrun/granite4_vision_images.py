"""Prompts with images, for Granite 4 Vision: each image prepared as LlavaNextImageProcessor
prepares it (llmrun.llava_images' tiles: a base tile, then the pinpoint's tiles), encoded
(llmrun.models.granite4_vision: K streams side by side) and laid out as LLaVA-NeXT's
pack_image_features lays them, on the downsampled grid (downsample_rate of the tower's
patches a side), each row's newline being image_newline in every stream; each <image>
that the chat template marks is expanded as Granite4VisionProcessor expands it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import llava_images
from llmrun.loading.granite4_vision import Granite4Vision


def _grid(vision: Granite4Vision, height: int, width: int) -> tuple[int, int, int, int]:
    """The tile grid (rows, columns) of an image and its feature grid's, once unpadded."""
    best = llava_images.best_resolution(height, width, vision.pinpoints)
    rows, columns = best[0] // vision.image_size, best[1] // vision.image_size
    side = vision.encoder.args.out_side
    return rows, columns, *llava_images.unpadded_grid(height, width, rows * side, columns * side)


def image_tokens(vision: Granite4Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    _, _, rows, columns = _grid(vision, image.height, image.width)
    return vision.encoder.args.out_side**2 + rows * (columns + 1)


def pack(vision: Granite4Vision, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The tokens [tokens, K * hidden] of an image of height x width from its tiles'
    features [1 + tiles, side², K * hidden] (pack_image_features)."""
    tile_rows, tile_columns, rows, columns = _grid(vision, height, width)
    side = vision.encoder.args.out_side
    width_ = features.shape[-1]
    # [tiles, side², w] -> [tile rows, side, tile columns, side, w] -> one grid
    grid = features[1:].view(tile_rows, tile_columns, side, side, width_).permute(0, 2, 1, 3, 4)
    grid = grid.reshape(tile_rows * side, tile_columns * side, width_)
    top, left = (grid.shape[0] - rows) // 2, (grid.shape[1] - columns) // 2
    grid = grid[top : top + rows, left : left + columns]
    newline = vision.encoder.image_newline.repeat(len(vision.encoder.args.streams))
    newlines = newline.expand(rows, 1, width_)
    return torch.cat([features[0], torch.cat([grid, newlines], dim=1).reshape(-1, width_)])


@torch.inference_mode()
def encode(vision: Granite4Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [tokens, K * hidden], encoded one image at a time."""
    out = []
    for image in images:
        features = vision.encoder(llava_images.pixel_values(vision, image))
        out.append(pack(vision, features, image.height, image.width))
    return out
