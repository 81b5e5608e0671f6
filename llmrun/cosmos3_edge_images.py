"""Prompts with images, for Cosmos3 Edge: each image resized as transformers'
Cosmos3EdgeImageProcessor (GLM-4V's, llmrun.glm4v_images.smart_resize, one frame) does and
cut into its patches (each patch's pixels row by row, their channels innermost), encoded
(llmrun.models.cosmos3_edge_vision), each image place that the chat template marks
(<|vision_start|><|image_pad|><|vision_end|>) expanded as Cosmos3EdgeProcessor (Qwen3-VL's)
expands it, one <|image_pad|> per merged token, and every token's M-RoPE positions as
Qwen2-VL's get_rope_index gives them (llmrun.qwen2_vl_images.prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import qwen2_vl_images
from llmrun.glm4v_images import resized_size
from llmrun.images import normalized
from llmrun.loading.cosmos3_edge_vision import Cosmos3EdgeVision
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

FAMILY = "Cosmos3 Edge"


def pixel_patches(image, vision: Cosmos3EdgeVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Cosmos3EdgeImageProcessorPil makes it: resized bicubically
    to smart_resize's size, / 255, (x - mean) / std, cut into patches: float32 [grid_h *
    grid_w, patch² * C] in 2x2 groups row by row, and the grid of patches (h, w)."""
    from PIL import Image

    args = vision.encoder.args
    patch, merge = args.patch_size, args.spatial_merge_size
    height, width = resized_size(vision, image)
    pixels = normalized(
        image.resize((width, height), Image.Resampling.BICUBIC), vision.mean, vision.std
    )
    channels, grid_h, grid_w = pixels.shape[0], height // patch, width // patch
    # [C, H, W] -> [h/m, w/m, m, m, P, P, C]: each 2x2 group's patches together
    grouped = pixels.view(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    grouped = grouped.permute(1, 4, 2, 5, 3, 6, 0)
    return grouped.reshape(grid_h * grid_w, -1), grid_h, grid_w


def image_tokens(vision: Cosmos3EdgeVision, image) -> int:
    """How many prompt tokens (<|image_pad|>s) a (Pillow) image takes: its merged patches
    at the size encode resizes it to, known before encoding it."""
    return qwen2_vl_images.merged_tokens(vision, *resized_size(vision, image))


def encode(vision: Cosmos3EdgeVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden] (its grid of merged patches),
    encoded one at a time."""
    return qwen2_vl_images.encode_each(vision, images, pixel_patches)


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|image_pad|> repeated once per merged token of the
    image `encoded` (encode's tokens) in order, and the images as generate() takes them
    (with their M-RoPE positions)."""
    markers = (qwen2_vl_images.VISION_START, qwen2_vl_images.IMAGE_PAD, qwen2_vl_images.VISION_END)
    return qwen2_vl_images.prompt(tokenizer, text, encoded, markers, FAMILY)
