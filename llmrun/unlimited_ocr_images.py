"""Prompts with images, for Unlimited-OCR: each image prepared as transformers'
UnlimitedOcrImageProcessor does with crops (DeepSeek-OCR 2's way, llmrun.deepseek_ocr2_images:
where its longer side is over a crop's, the image resized onto the grid of 2 to 32 crops
whose aspect is nearest its own and cut row by row; the whole image resized to fit the
global size, centred on a square of the background colour). Each view is encoded
(llmrun.models.unlimited_ocr_vision); the crops' grids are laid side by side as one grid,
each of its rows closed by the learned image_newline, then the whole image's grid the same
way, then the view separator (UnlimitedOcrModel.get_image_features), each in the place of
one <image> token: UnlimitedOcrProcessor repeats each <image> of the text for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.deepseek_ocr2_images import crop_grid, views
from llmrun.errors import UsageError
from llmrun.loading.unlimited_ocr_vision import UnlimitedOcrVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<image>"


def image_tokens(vision: UnlimitedOcrVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    longer = max(image.width, image.height)
    if not round(min(image.width, image.height) * vision.size / longer):
        raise UsageError(
            f"an image of {image.width}x{image.height} pixels is too thin for Unlimited-OCR's "
            f"{vision.size}-pixel whole view"
        )
    columns, rows = crop_grid(vision, image)
    crops = rows * vision.crop_side * (columns * vision.crop_side + 1) if columns else 0
    return crops + vision.global_side * (vision.global_side + 1) + 1


def _with_newlines(grid: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    """A grid of tokens [h, w, hidden] row by row, each row closed by `newline`."""
    height = grid.shape[0]
    return torch.cat([grid, newline.expand(height, 1, -1)], dim=1).flatten(0, 1)


@torch.inference_mode()
def encode(vision: UnlimitedOcrVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [image_tokens, text hidden], encoded one image at a
    time."""
    out = []
    encoder = vision.encoder
    newline = encoder.image_newline
    for image in images:
        image_tokens(vision, image)  # refuses an image too thin for its whole view
        crops, whole = views(vision, image)
        parts = []
        if crops is not None:
            columns, rows = crop_grid(vision, image)
            grids = encoder(crops)  # [rows * columns, side, side, hidden], row by row
            side, hidden = grids.shape[1], grids.shape[-1]
            # the crops' grids as one [rows * side, columns * side] grid
            joined = grids.reshape(rows, columns, side, side, hidden).transpose(1, 2)
            parts.append(_with_newlines(joined.reshape(rows * side, columns * side, -1), newline))
        parts += [_with_newlines(encoder(whole[None])[0], newline), encoder.view_seperator[None]]
        out.append(torch.cat(parts))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "Unlimited-OCR")
