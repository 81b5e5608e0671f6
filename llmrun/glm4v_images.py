"""Prompts with images, for GLM-4.1V, GLM-4.5V and GLM-OCR: each image resized and cut into patches
as transformers' Glm4vImageProcessor does, encoded (llmrun.models.glm4v_vision), each image
place that the chat template marks (<|begin_of_image|><|image|><|end_of_image|>) expanded
as Glm4vProcessor expands it (one <|image|> per merged token), and every token's M-RoPE
positions (llmrun.models.mrope) as Glm4vModel.get_rope_index gives them: Qwen2-VL's
(llmrun.qwen2_vl_images.rope_index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmrun import qwen2_vl_images
from llmrun.errors import UsageError
from llmrun.loading.cosmos3_edge_vision import Cosmos3EdgeVision
from llmrun.loading.glm4v_vision import Glm4vVision
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

IMAGE_START, IMAGE, IMAGE_END = "<|begin_of_image|>", "<|image|>", "<|end_of_image|>"
# Glm4vImageProcessor refuses images longer than this many times their width (or wider).
MAX_ASPECT = 200


def smart_resize(
    height: int, width: int, factor: int, frames: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) Glm4vImageProcessor resizes an image to: a side shorter than
    `factor` scaled up to it (keeping the aspect), each side rounded to a multiple of
    `factor`, then scaled into min_pixels..max_pixels, which count the `frames` of a
    still image."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UsageError(
            f"a {width}x{height} image: GLM-4V takes images at most {MAX_ASPECT} times as "
            "long as they are wide"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(vision: Glm4vVision | Cosmos3EdgeVision, image) -> tuple[int, int]:
    """The (height, width) a (Pillow) image is resized to for `vision`'s tower: smart_resize
    in whole merged patches (Cosmos3 Edge's processor resizes as GLM-4V's)."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    # A still image is temporal_patch_size frames (round(frames / t) * t of them).
    frames = args.temporal_patch_size
    return smart_resize(
        image.height, image.width, unit, frames, vision.min_pixels, vision.max_pixels
    )


def pixel_patches(image, vision: Glm4vVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Glm4vImageProcessor's Pillow backend makes it: Qwen2-VL's
    patches (llmrun.qwen2_vl_images.frame_patches) at resized_size."""
    return qwen2_vl_images.frame_patches(image, vision, *resized_size(vision, image))


def image_tokens(vision: Glm4vVision, image) -> int:
    """How many prompt tokens (<|image|>s) a (Pillow) image takes: its merged patches at
    the size encode resizes it to, known before encoding it."""
    return qwen2_vl_images.merged_tokens(vision, *resized_size(vision, image))


def encode(vision: Glm4vVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden] (its grid of merged patches),
    encoded one at a time."""
    return qwen2_vl_images.encode_each(vision, images, pixel_patches)


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|image|> repeated once per merged token of the image
    `encoded` (encode's tokens) in order, and the images as generate() takes them (with
    their M-RoPE positions): Qwen2-VL's layout and positions under GLM-4V's token names.
    The text must mark exactly as many places as there are images."""
    markers = (IMAGE_START, IMAGE, IMAGE_END)
    return qwen2_vl_images.prompt(tokenizer, text, encoded, markers, "GLM-4V")
