"""Prompts with images for HunYuan-VL (HunyuanOCR): each image resized and cut into patches
as transformers' HunYuanVLImageProcessor does (Qwen2-VL's sizes, patches row by row),
encoded (llmrun.models.hunyuan_vl_vision), each image place that the chat template marks
(IMAGE_START IMAGE_PAD IMAGE_END) expanded as HunYuanVLProcessor expands it (one IMAGE_PAD
per token: the begin token, each row's merged patches and newline, the end token), and
every token's XD-RoPE positions as HunYuanVLModel.get_rope_index gives them, as four rows
(place, column, row, image index) that the language model spreads over its axes (llmrun.
models.hunyuan_v1_dense): a text token (and an image's begin and end tokens) at its place
on every row, an image's row tokens at their column, row and image index, the newline as
one more column. Text after an image stays at its place: nothing shifts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.hunyuan_vl_vision import HunyuanVision
from llmrun.models.mrope import MRopeImages
from llmrun.multimodal import PromptImages
from llmrun.qwen2_vl_images import MAX_ASPECT, smart_resize
from llmrun.tokenizer import Tokenizer

IMAGE_START = "<｜hy_place▁holder▁no▁100｜>"
IMAGE_END = "<｜hy_place▁holder▁no▁101｜>"
IMAGE_PAD = "<｜hy_place▁holder▁no▁102｜>"


@dataclass
class EncodedImage:
    """An image's tokens [1 + rows * (columns + 1) + 1, hidden] and its grid of merged
    patches (rows x columns)."""

    tokens: torch.Tensor
    rows: int
    columns: int


def resized_size(vision: HunyuanVision, height: int, width: int) -> tuple[int, int]:
    """The (height, width) HunYuanVLImageProcessor resizes an image to (Qwen2-VL's
    smart_resize by merged patches)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UsageError(
            f"a {width}x{height} image: HunYuan-VL takes images at most {MAX_ASPECT} times "
            "as long as they are wide"
        )
    args = vision.encoder.args
    factor = args.patch_size * args.spatial_merge_size
    return smart_resize(height, width, factor, vision.min_pixels, vision.max_pixels)


def pixel_patches(image, vision: HunyuanVision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as HunYuanVLImageProcessorPil makes it: resized bicubically to
    resized_size, / 255, (x - mean) / std, cut into patches: float32 [grid_h * grid_w,
    C * patch²] row by row, and the grid of patches (h, w)."""
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


def image_tokens(vision: HunyuanVision, image) -> int:
    """How many prompt tokens (IMAGE_PADs) a (Pillow) image takes at the size encode
    resizes it to, known before encoding it: its rows of merged patches, each with a
    newline, and the begin and end tokens."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    height, width = resized_size(vision, image.height, image.width)
    return (height // unit) * (width // unit + 1) + 2


@torch.inference_mode()
def encode(vision: HunyuanVision, images: Sequence) -> list[EncodedImage]:
    """Each (Pillow) image's tokens and grid, encoded one at a time."""
    merge = vision.encoder.args.spatial_merge_size
    out = []
    for image in images:
        patches, grid_h, grid_w = pixel_patches(image, vision)
        tokens = vision.encoder(patches, grid_h, grid_w)
        out.append(EncodedImage(tokens, grid_h // merge, grid_w // merge))
    return out


def rope_index(length: int, starts: Sequence[int], images: Sequence[EncodedImage]) -> torch.Tensor:
    """The XD-RoPE positions [4, length] (place, column, row, image index) of a prompt
    whose images' tokens begin at `starts`: every token at its place on each row, but for
    each image's rows of merged patches (and their newlines), whose last three rows take
    their column, row and image index."""
    rope = torch.arange(length).expand(4, -1).clone()
    for index, (start, image) in enumerate(zip(starts, images, strict=True)):
        rows, columns = image.rows, image.columns + 1  # each row's newline a column more
        first = start + 1  # after the begin token
        grid = slice(first, first + rows * columns)
        rope[1, grid] = torch.arange(columns).repeat(rows)
        rope[2, grid] = torch.arange(rows).repeat_interleave(columns)
        rope[3, grid] = index
    return rope


@dataclass
class HunyuanPromptImages(PromptImages):
    """PromptImages with every prompt token's XD-RoPE positions `rope` [4, length]."""

    rope: torch.Tensor | None = None

    def tokens(self, begin: int, end: int, device: torch.device) -> MRopeImages | None:
        """What the forward of prompt[begin:end] takes of the images; None if none."""
        found = super().tokens(begin, end, device)
        if found is None:
            return None
        return MRopeImages(found.embeds, found.groups, self.rope[:, begin:end], 0)


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[EncodedImage]
) -> tuple[list[int], HunyuanPromptImages]:
    """The ids of `text` with each IMAGE_PAD repeated once per token of the image `encoded`
    (encode's) in order, and the images as generate() takes them. The text must mark
    exactly as many places as there are images."""
    missing = [t for t in (IMAGE_START, IMAGE_PAD, IMAGE_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not HunYuan-VL's")
    pad = tokenizer.token_id(IMAGE_PAD)
    places = text.count(IMAGE_PAD)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE_PAD}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write "
            f"{IMAGE_START}{IMAGE_PAD}{IMAGE_END} where each goes"
        )
    pieces = text.split(IMAGE_PAD)
    expanded = pieces[0] + "".join(
        IMAGE_PAD * len(image.tokens) + piece
        for image, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
    if len(starts) != len(encoded) or ids.count(pad) != sum(len(e.tokens) for e in encoded):
        raise UsageError(f"the prompt holds {IMAGE_PAD} of its own: remove it")
    rope = rope_index(len(ids), starts, encoded)
    return ids, HunyuanPromptImages([e.tokens for e in encoded], starts, rope)
