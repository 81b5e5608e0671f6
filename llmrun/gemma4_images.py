"""Prompts with images, for Gemma 4: each image resized as Gemma4ImageProcessor resizes
it (its aspect ratio kept, to the most patches the soft-token budget allows, both sides
multiples of patch * pooling pixels; Pillow's bicubic filter), scaled to [0, 1] and cut
into patches; each image place the chat template marks (<|image|>) expanded as
Gemma4Processor expands it: <|image>, one <|image|> per soft token (the image's pooled
patches, so their number follows its shape), <image|>.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.gemma4_vision import Gemma4Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE_BEGIN, IMAGE_SOFT, IMAGE_END = "<|image>", "<|image|>", "<image|>"


def target_size(height: int, width: int, patch: int, pool: int, tokens: int) -> tuple[int, int]:
    """The (height, width) Gemma4ImageProcessor resizes an image to: the largest of its
    aspect ratio with at most tokens * pool^2 patches, each side a multiple of patch *
    pool (get_aspect_ratio_preserving_size)."""
    max_patches = tokens * pool**2
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = pool * patch
    target_h = int(math.floor(factor * height / side)) * side
    target_w = int(math.floor(factor * width / side)) * side
    if target_h == 0 and target_w == 0:
        raise UsageError(f"a {width}x{height} image is too small for Gemma 4's patches")
    longest = (max_patches // pool**2) * side
    if target_h == 0:
        target_h, target_w = side, min(int(math.floor(width / height)) * side, longest)
    elif target_w == 0:
        target_w, target_h = side, min(int(math.floor(height / width)) * side, longest)
    if target_h * target_w > max_patches * patch**2:
        raise UsageError(
            f"a {width}x{height} image does not fit Gemma 4's {max_patches} patches: "
            "crop it nearer to a square"
        )
    return target_h, target_w


def image_tokens(vision: Gemma4Vision, image) -> int:
    """The soft tokens of an (RGB Pillow) image: its pooled patches once resized."""
    height, width = target_size(
        image.height, image.width, vision.patch_size, vision.pool, vision.max_soft_tokens
    )
    side = vision.patch_size * vision.pool
    return (height // side) * (width // side)


def patches(vision: Gemma4Vision, image) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB Pillow image's patches [N, patch * patch * 3] (pixels in [0, 1], each patch's
    rows, then columns, then channels) and their (column, row) positions [N, 2], row by
    row, as Gemma4ImageProcessor gives them (without its padding)."""
    from PIL import Image

    patch = vision.patch_size
    size = target_size(image.height, image.width, patch, vision.pool, vision.max_soft_tokens)
    if size != (image.height, image.width):
        image = image.resize(size[::-1], Image.Resampling.BICUBIC)
    pixels = normalized(image, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    rows, columns = size[0] // patch, size[1] // patch
    # [3, H, W] -> [rows, columns, patch, patch, 3] -> [rows * columns, patch * patch * 3]
    cut = pixels.view(3, rows, patch, columns, patch).permute(1, 3, 2, 4, 0)
    index = torch.arange(rows * columns)
    positions = torch.stack([index % columns, index // columns], dim=-1)
    return cut.reshape(rows * columns, -1), positions


@torch.inference_mode()
def encode(vision: Gemma4Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tokens, text hidden], one image at a time."""
    return [vision.encoder(*patches(vision, image)) for image in images]


def _soft_token(tokenizer: Tokenizer) -> int:
    """The id of <|image|>, where the tokenizer has Gemma 4's three image tokens."""
    markers = (IMAGE_BEGIN, IMAGE_SOFT, IMAGE_END)
    missing = [text for text in markers if tokenizer.token_id(text) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Gemma 4's")
    return tokenizer.token_id(IMAGE_SOFT)


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image|> expanded for its image's soft tokens, and the
    images' places in them. The text must mark exactly one place per image."""
    soft = _soft_token(tokenizer)
    pieces = text.split(IMAGE_SOFT)
    places = len(pieces) - 1
    if places != len(embeds):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE_SOFT}) "
            f"for {len(embeds)} image{'s' * (len(embeds) != 1)}: write {IMAGE_SOFT} where "
            "each goes"
        )
    expanded = pieces[0]
    for piece, embed in zip(pieces[1:], embeds, strict=True):
        expanded += f"{IMAGE_BEGIN}{IMAGE_SOFT * len(embed)}{IMAGE_END}{piece}"
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == soft and (i == 0 or ids[i - 1] != soft)]
    # Each image's soft tokens one run, between its markers: a tokenizer that merges
    # them with their neighbours is not Gemma 4's.
    runs = [len(e) for e in embeds]
    found = [next((j for j in range(s, len(ids)) if ids[j] != soft), len(ids)) - s for s in starts]
    if found != runs:
        raise TokenizerError(f"the tokenizer does not keep {IMAGE_SOFT} whole: not Gemma 4's")
    return ids, PromptImages(list(embeds), starts)
