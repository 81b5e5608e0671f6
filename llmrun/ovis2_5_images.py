"""Prompts with images, for Ovis2.5: each image resized and cut into patches as
transformers' Ovis2_5ImageProcessorPil does (Qwen2-VL's patches in 2x2 groups, one frame,
Ovis's own resizing), encoded (llmrun.models.ovis2_5_vision), and each image place of the
prompt (the config's image token, as the chat template writes it) expanded as
Ovis2_5Processor expands it: the image start token, one image token per merged token, the
image end token. The start and end tokens take the visual embedding table's first two
indicator rows, so an image's span of PromptImages runs from its start token to its end
token; the language model turns every token by its place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.errors import TokenizerError
from llmrun.images import normalized
from llmrun.loading.ovis2_5_vision import Ovis25Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

MAX_ASPECT = 200  # longer sides are cut to this many times the shorter


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) Ovis2_5ImageProcessor resizes an image to: a side under
    `factor` raised to it (the other scaled along), an aspect over MAX_ASPECT cut to it,
    each side rounded to a multiple of `factor`, then scaled (keeping the aspect) into
    min_pixels..max_pixels."""
    if height < factor or width < factor:
        if height < width:
            height, width = factor, round(factor / height * width)
        else:
            height, width = round(factor / width * height), factor
    elif max(height, width) / min(height, width) > MAX_ASPECT:
        if height > width:
            height = MAX_ASPECT * width
        else:
            width = MAX_ASPECT * height
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _size(vision: Ovis25Vision, image) -> tuple[int, int]:
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    return smart_resize(image.height, image.width, unit, vision.min_pixels, vision.max_pixels)


def pixel_patches(image, vision: Ovis25Vision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Ovis2_5ImageProcessorPil makes it: resized bilinearly to
    smart_resize's size, / 255, (x - mean) / std, cut into patches: float32
    [grid_h * grid_w, 3 * patch²] in 2x2 groups row by row, and the grid of patches (h, w)."""
    from PIL import Image

    args = vision.encoder.args
    patch, merge = args.patch_size, args.spatial_merge_size
    height, width = _size(vision, image)
    pixels = normalized(
        image.resize((width, height), Image.Resampling.BILINEAR), vision.mean, vision.std
    )
    grid_h, grid_w = height // patch, width // patch
    # [3, H, W] -> [h/m, w/m, m, m, 3, P, P]: each 2x2 group's patches together
    grouped = pixels.view(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    return grouped.permute(1, 4, 2, 5, 0, 3, 6).reshape(grid_h * grid_w, -1), grid_h, grid_w


def image_tokens(vision: Ovis25Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes: its merged patches at the size
    encode resizes it to, and its start and end tokens."""
    unit = vision.encoder.args.patch_size * vision.encoder.args.spatial_merge_size
    height, width = _size(vision, image)
    return (height // unit) * (width // unit) + 2


@torch.inference_mode()
def encode(vision: Ovis25Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's embeddings [1 + tokens + 1, hidden]: the start indicator's,
    its merged tokens' row by row, the end indicator's; encoded one at a time."""
    opening, closing = vision.encoder.indicators()[:2]
    out = []
    for image in images:
        tokens = vision.encoder(*pixel_patches(image, vision))
        out.append(torch.cat([opening[None], tokens, closing[None]]))
    return out


def prompt(
    vision: Ovis25Vision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each image token made the start token, one image token per
    merged token of the image `encoded` (encode's), the end token; and the images (their
    indicators with them) as generate() takes them."""
    ids = (vision.image_token_id, vision.image_start_token_id, vision.image_end_token_id)
    if max(ids) >= tokenizer.vocab_size:
        raise TokenizerError(
            f"the tokenizer has no token {max(ids)} (Ovis2.5's image tokens): not Ovis2.5's"
        )
    image, start, end = (tokenizer.token_to_piece(i) for i in ids)
    framed = text.replace(image, start + image + end)
    ids, places = multimodal.pad_prompt(
        tokenizer, framed, [e[1:-1] for e in encoded], image, "Ovis2.5"
    )
    return ids, PromptImages(list(encoded), [s - 1 for s in places.starts])
