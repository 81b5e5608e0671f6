"""Prompts with images for PaddleOCR-VL: each image resized and cut into patches as
transformers' PaddleOCRVLImageProcessor does, encoded (llmrun.models.paddleocr_vl_vision),
each image place that the chat template marks
(<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>) expanded as PaddleOCRVLProcessor
expands it (one <|IMAGE_PLACEHOLDER|> per merged token), and every token's M-RoPE
positions as PaddleOCRVLModel.get_rope_index gives them (Qwen2-VL's: llmrun.qwen2_vl_images).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import qwen2_vl_images
from llmrun.errors import UsageError
from llmrun.images import normalized
from llmrun.loading.paddleocr_vl_vision import PaddleOCRVision
from llmrun.qwen2_vl_images import MAX_ASPECT, QwenPromptImages, smart_resize
from llmrun.tokenizer import Tokenizer

IMAGE_START, IMAGE_PAD, IMAGE_END = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"


def resized_size(vision: PaddleOCRVision, height: int, width: int) -> tuple[int, int]:
    """The (height, width) PaddleOCRVLImageProcessor resizes an image to: a side shorter
    than a merged patch stretched to one (the other scaled alike), then Qwen2-VL's
    smart_resize."""
    args = vision.encoder.args
    factor = args.patch_size * args.spatial_merge_size
    if height < factor:
        height, width = factor, round(width * factor / height)
    if width < factor:
        height, width = round(height * factor / width), factor
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UsageError(
            f"a {width}x{height} image: PaddleOCR-VL takes images at most {MAX_ASPECT} times "
            "as long as they are wide"
        )
    return smart_resize(height, width, factor, vision.min_pixels, vision.max_pixels)


def pixel_patches(image, vision: PaddleOCRVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as PaddleOCRVLImageProcessor's Pillow backend makes it: resized
    bicubically to resized_size, / 255, (x - mean) / std, cut into patches: float32
    [grid_h * grid_w, C * patch²] row by row, and the grid of patches (h, w)."""
    from PIL import Image

    patch = vision.encoder.args.patch_size
    height, width = resized_size(vision, image.height, image.width)
    pixels = normalized(
        image.resize((width, height), Image.Resampling.BICUBIC), vision.mean, vision.std
    )
    channels, grid_h, grid_w = pixels.shape[0], height // patch, width // patch
    # [C, H, W] -> [h, w, C, P, P]
    patches = pixels.view(channels, grid_h, patch, grid_w, patch).permute(1, 3, 0, 2, 4)
    return patches.reshape(grid_h * grid_w, -1), grid_h, grid_w


def image_tokens(vision: PaddleOCRVision, image) -> int:
    """How many prompt tokens (<|IMAGE_PLACEHOLDER|>s) a (Pillow) image takes: its merged
    patches at the size encode resizes it to, known before encoding it."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    height, width = resized_size(vision, image.height, image.width)
    return (height // unit) * (width // unit)


@torch.inference_mode()
def encode(vision: PaddleOCRVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden] (its grid of merged patches),
    encoded one at a time."""
    merge = vision.encoder.args.spatial_merge_size
    out = []
    for image in images:
        patches, grid_h, grid_w = pixel_patches(image, vision)
        tokens = vision.encoder(patches, grid_h, grid_w)
        out.append(tokens.view(grid_h // merge, grid_w // merge, -1))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|IMAGE_PLACEHOLDER|> repeated once per merged token of
    the image `encoded` (encode's tokens) in order, and the images as generate() takes
    them: Qwen2-VL's layout and positions, under PaddleOCR-VL's token names."""
    markers = (IMAGE_START, IMAGE_PAD, IMAGE_END)
    return qwen2_vl_images.prompt(tokenizer, text, encoded, markers, "PaddleOCR-VL")
