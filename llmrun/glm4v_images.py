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

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.glm4v_vision import Glm4vVision
from llmrun.qwen2_vl_images import QwenPromptImages, rope_index
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


def _size(vision: Glm4vVision, image) -> tuple[int, int]:
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    # A still image is temporal_patch_size frames (round(frames / t) * t of them).
    frames = args.temporal_patch_size
    return smart_resize(
        image.height, image.width, unit, frames, vision.min_pixels, vision.max_pixels
    )


def pixel_patches(image, vision: Glm4vVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Glm4vImageProcessor's Pillow backend makes it: resized
    bicubically to smart_resize's size, / 255, (x - mean) / std, cut into patches of
    temporal_patch_size frames (the image repeated): float32 [grid_h * grid_w,
    C * frames * patch²] in 2x2 groups row by row, and the grid of patches (h, w)."""
    from PIL import Image

    args = vision.encoder.args
    patch, merge, frames = args.patch_size, args.spatial_merge_size, args.temporal_patch_size
    height, width = _size(vision, image)
    pixels = normalized(
        image.resize((width, height), Image.Resampling.BICUBIC), vision.mean, vision.std
    )
    channels, grid_h, grid_w = pixels.shape[0], height // patch, width // patch
    # [C, H, W] -> [h/m, w/m, m, m, C, P, P]: each 2x2 group's patches together
    grouped = pixels.view(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    grouped = grouped.permute(1, 4, 2, 5, 0, 3, 6)
    # The frames of a still image: the same pixels again -> [..., C, frames, P, P]
    repeated = grouped[:, :, :, :, :, None].expand(*grouped.shape[:5], frames, patch, patch)
    return repeated.reshape(grid_h * grid_w, -1), grid_h, grid_w


def image_tokens(vision: Glm4vVision, image) -> int:
    """How many prompt tokens (<|image|>s) a (Pillow) image takes: its merged patches at
    the size encode resizes it to, known before encoding it."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    height, width = _size(vision, image)
    return (height // unit) * (width // unit)


@torch.inference_mode()
def encode(vision: Glm4vVision, images: Sequence) -> list[torch.Tensor]:
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
    """The ids of `text` with each <|image|> repeated once per merged token of the image
    `encoded` (encode's tokens) in order, and the images as generate() takes them (with
    their M-RoPE positions). The text must mark exactly as many places as there are
    images."""
    missing = [t for t in (IMAGE_START, IMAGE, IMAGE_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not GLM-4V's")
    pad = tokenizer.token_id(IMAGE)
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write "
            f"{IMAGE_START}{IMAGE}{IMAGE_END} where each goes"
        )
    grids = [(int(e.shape[0]), int(e.shape[1])) for e in encoded]
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        IMAGE * (rows * columns) + piece
        for (rows, columns), piece in zip(grids, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
    if len(starts) != len(encoded) or ids.count(pad) != sum(r * c for r, c in grids):
        raise UsageError(f"the prompt holds {IMAGE} of its own: remove it")
    embeds = [e.flatten(0, 1) for e in encoded]
    return ids, QwenPromptImages(embeds, starts, rope_index(len(ids), starts, grids))
