"""Prompts with images, for Kimi K2.5: each image resized and padded as transformers'
Kimi_K25ImageProcessor does (navit_resize: shrunk, never enlarged, to at most max_patches
patches and max_side patches a side; bicubic, antialiased, on the uint8 pixels, as its
torchvision backend resizes; zeros to the right and below up to whole 2x2 groups of
patches), cut into patches row by row, encoded (llmrun.models.kimi_k25_vision), and each
image place that the chat template marks (<|media_pad|>) expanded as Kimi_K25Processor
expands it: one <|media_pad|> per merged token. An image's embeddings take the place of
its tokens: one span per image, as llmrun.multimodal.PromptImages and the server's prefix
cache take them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from llmrun import multimodal
from llmrun.loading.kimi_k25_vision import KimiK25Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|media_pad|>"


def resized_size(vision: KimiK25Vision, height: int, width: int) -> tuple[int, int]:
    """The (height, width) an image is resized to (navit_resize's first size)."""
    patch = vision.patch_size
    patches = max(1.0, height // patch) * max(1.0, width // patch)
    scale = min(
        1.0,
        math.sqrt(vision.max_patches / patches),
        vision.max_side * patch / height,
        vision.max_side * patch / width,
    )
    new_height = min(max(1, int(height * scale)), vision.max_side * patch)
    new_width = min(max(1, int(width * scale)), vision.max_side * patch)
    return new_height, new_width


def grid(vision: KimiK25Vision, image) -> tuple[int, int]:
    """The rows and columns of patches a (Pillow) image takes, padded to whole groups."""
    unit = vision.patch_size * vision.merge_size
    height, width = resized_size(vision, image.height, image.width)
    return -(-height // unit) * vision.merge_size, -(-width // unit) * vision.merge_size


def image_tokens(vision: KimiK25Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    rows, columns = grid(vision, image)
    return rows * columns // vision.merge_size**2


def pixel_patches(image, vision: KimiK25Vision) -> tuple[torch.Tensor, int, int]:
    """Float32 patches [rows * columns, 3 * patch²] of an RGB Pillow image, row by row,
    and its grid of patches (rows, columns)."""
    rows, columns = grid(vision, image)
    height, width = resized_size(vision, image.height, image.width)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    if (height, width) != (image.height, image.width):
        # torch's uint8 bicubic, which torchvision's resize calls on the CPU.
        pixels = F.interpolate(
            pixels, (height, width), mode="bicubic", align_corners=False, antialias=True
        )
    p = vision.patch_size
    canvas = torch.zeros(3, rows * p, columns * p, dtype=torch.uint8)
    canvas[:, :height, :width] = pixels[0]
    # The processor's fused rescale and normalize: (x - 255 mean) / (255 std) in float32.
    mean = torch.tensor(vision.mean) * (1.0 / (1 / 255))
    std = torch.tensor(vision.std) * (1.0 / (1 / 255))
    normalized = (canvas.float() - mean[:, None, None]) / std[:, None, None]
    # [3, rows * p, columns * p] -> [rows, columns, 3, p, p] -> [rows * columns, 3 * p * p]
    patches = normalized.view(3, rows, p, columns, p).permute(1, 3, 0, 2, 4)
    return patches.reshape(rows * columns, -1), rows, columns


@torch.inference_mode()
def encode(vision: KimiK25Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows/2 * columns/2, hidden], encoded one at a time."""
    out = []
    for image in images:
        patches, rows, columns = pixel_patches(image, vision)
        out.append(vision.encoder(patches, rows, columns))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|media_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "Kimi K2.5")
