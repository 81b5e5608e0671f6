"""Images for Pix2Struct, which reads one image and (its captioning models) takes no
prompt: the image standardized by its own mean and deviation, resized (bilinear,
antialiased, in float32 as torch does it) to the most whole patches within max_patches at
its aspect ratio, and cut into patches, each flattened (its rows of pixels, channels last)
after its 1-based row and column ids, as Pix2StructImageProcessor does (without its
padding patches, which the model masks); encoded by its encoder
(llmrun.models.pix2struct_vision), whose states are the decoder's source
(llmrun.models.pix2struct). The prompt is one placeholder, the image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmrun.errors import UsageError
from llmrun.loading.pix2struct_vision import Pix2StructVision
from llmrun.multimodal import FramedImages
from llmrun.tokenizer import Tokenizer

PLACEHOLDER = 0  # never embedded: the image's states are the source


def grid(vision: Pix2StructVision, height: int, width: int) -> tuple[int, int]:
    """The rows and columns of patches an image of height x width is resized to."""
    patch_h, patch_w = vision.patch
    cap = vision.max_patches
    scale = math.sqrt(cap * (patch_h / height) * (patch_w / width))
    rows = max(min(int(scale * height / patch_h), cap), 1)
    columns = max(min(int(scale * width / patch_w), cap), 1)
    return rows, columns


def flattened_patches(vision: Pix2StructVision, image: Any) -> torch.Tensor:
    """An RGB Pillow image's patches [rows * columns, 2 + 3 * patch pixels]."""
    # [H, W, 3] uint8 -> [3, H, W] float32, standardized in numpy as the processor does.
    pixels = np.asarray(image).transpose(2, 0, 1).astype(np.float32)
    if vision.normalize:
        deviation = max(np.std(pixels), 1.0 / math.sqrt(np.prod(pixels.shape)))
        pixels = (pixels - np.mean(pixels)) / deviation
    rows, columns = grid(vision, image.height, image.width)
    patch_h, patch_w = vision.patch
    resized = F.interpolate(
        torch.from_numpy(pixels)[None].float(),
        size=(rows * patch_h, columns * patch_w),
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )
    # [1, 3 * ph * pw, rows * columns] -> [rows * columns, ph, pw, 3] -> flattened
    cut = F.unfold(resized, (patch_h, patch_w), stride=(patch_h, patch_w))
    cut = cut.reshape(3, patch_h, patch_w, -1).permute(3, 1, 2, 0).reshape(rows * columns, -1)
    ids = torch.cartesian_prod(torch.arange(rows), torch.arange(columns)).float() + 1
    return torch.cat([ids, cut], dim=-1)


def image_tokens(vision: Pix2StructVision, image: Any) -> int:
    """How many prompt tokens an image takes: its placeholder."""
    return 1


@torch.inference_mode()
def encode(vision: Pix2StructVision, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each (Pillow) image's patch states [patches, hidden]."""
    return [vision.encoder(flattened_patches(vision, image)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], FramedImages]:
    """The prompt of the one image `encoded`, its placeholder; the captioning models take
    no text."""
    if text:
        raise UsageError(
            "Pix2Struct's captioning models take no prompt (the VQA ones, which would "
            "render it into the image, are not run): give --image alone"
        )
    if len(encoded) != 1:
        raise UsageError(f"Pix2Struct reads one image at a time, not {len(encoded)}")
    return [PLACEHOLDER], FramedImages(list(encoded), [0])
