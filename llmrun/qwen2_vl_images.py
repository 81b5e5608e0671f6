"""Prompts with images, for Qwen2-VL and Qwen2.5-VL, and for Qwen3-VL and Qwen3.5, whose
processor and prompts are the same: each image resized and cut into patches as
transformers' Qwen2VLImageProcessor does, encoded (llmrun.models.qwen2_vl_vision, or
llmrun.models.qwen3_vl_vision, whose tokens carry deepstack features after them), each
image place that the chat template marks (<|vision_start|><|image_pad|><|vision_end|>)
expanded as Qwen2_5_VLProcessor and Qwen3VLProcessor expand it (one <|image_pad|> per
merged token), and every token's M-RoPE positions (llmrun.models.mrope) as get_rope_index
gives them (Qwen3-VL's is the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.qwen2_vl_vision import QwenVision
from llmrun.loading.qwen3_vl_vision import Qwen3Vision
from llmrun.models.mrope import MRopeImages
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# Qwen2.5-Omni's tokenizer names the same three tokens otherwise.
OMNI_MARKERS = ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")
# Qwen2VLImageProcessor refuses images longer than this many times their width (or wider).
MAX_ASPECT = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) Qwen2VLImageProcessor resizes an image to: each side rounded to
    a multiple of `factor`, then scaled (keeping the aspect) into min_pixels..max_pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UsageError(
            f"a {width}x{height} image: Qwen2-VL takes images at most {MAX_ASPECT} times as "
            "long as they are wide"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_patches(image, vision: QwenVision | Qwen3Vision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Qwen2VLImageProcessor's Pillow backend makes it: frame_patches
    at smart_resize's size."""
    args = vision.encoder.args
    height, width = smart_resize(
        image.height,
        image.width,
        args.patch_size * args.spatial_merge_size,
        vision.min_pixels,
        vision.max_pixels,
    )
    return frame_patches(image, vision, height, width)


def frame_patches(image, vision: Any, height: int, width: int) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image resized bicubically to `height` x `width`, / 255, (x - mean) /
    std, cut into patches of temporal_patch_size frames (the image repeated): float32
    [grid_h * grid_w, C * frames * patch²] in 2x2 groups row by row, and the grid of
    patches (h, w). `vision` is a loaded tower with Qwen2-VL's patches (its encoder's args,
    its mean and std)."""
    from PIL import Image

    args = vision.encoder.args
    patch, merge, frames = args.patch_size, args.spatial_merge_size, args.temporal_patch_size
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


def image_tokens(vision: QwenVision | Qwen3Vision, image) -> int:
    """How many prompt tokens (<|image_pad|>s) a (Pillow) image takes: its merged patches
    at the size encode resizes it to, known before encoding it."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    height, width = smart_resize(
        image.height, image.width, unit, vision.min_pixels, vision.max_pixels
    )
    return merged_tokens(vision, height, width)


def merged_tokens(vision: Any, height: int, width: int) -> int:
    """How many merged patches (prompt tokens) an image resized to `height` x `width`
    gives the tower `vision`."""
    args = vision.encoder.args
    unit = args.patch_size * args.spatial_merge_size
    return (height // unit) * (width // unit)


def encode(vision: QwenVision | Qwen3Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden] (its grid of merged patches;
    Qwen3-VL's hidden * (1 + deepstack layers) wide), encoded one at a time."""
    return encode_each(vision, images, pixel_patches)


@torch.inference_mode()
def encode_each(
    vision: Any, images: Sequence, patches_of: Callable[[Any, Any], tuple[torch.Tensor, int, int]]
) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden] (its grid of merged patches),
    cut into patches by `patches_of` (a family's pixel_patches) and encoded one at a time
    by the tower `vision`."""
    merge = vision.encoder.args.spatial_merge_size
    out = []
    for image in images:
        patches, grid_h, grid_w = patches_of(image, vision)
        tokens = vision.encoder(patches, grid_h, grid_w)
        out.append(tokens.view(grid_h // merge, grid_w // merge, -1))
    return out


def rope_index(
    length: int, starts: Sequence[int], grids: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """The (time, height, width) positions [3, length] of a prompt whose images (of grids
    rows x columns merged tokens) begin at `starts`: text at one position more than the
    last token's largest, an image's token at (p, p + row, p + column) where p is the
    position its first would have as text (transformers' get_rope_index)."""
    pieces, position, done = [], 0, 0
    for start, (rows, columns) in zip(starts, grids, strict=True):
        pieces.append(torch.arange(position, position + start - done).expand(3, -1))
        position += start - done
        row = torch.arange(rows)[:, None].expand(rows, columns).flatten()
        column = torch.arange(columns)[None, :].expand(rows, columns).flatten()
        pieces.append(torch.stack([torch.zeros_like(row), row, column]) + position)
        position += max(rows, columns)
        done = start + rows * columns
    pieces.append(torch.arange(position, position + length - done).expand(3, -1))
    return torch.cat(pieces, dim=1)


@dataclass
class QwenPromptImages(PromptImages):
    """PromptImages with every prompt token's M-RoPE positions `rope` [3, length]."""

    rope: torch.Tensor | None = None

    def tokens(self, begin: int, end: int, device: torch.device) -> MRopeImages | None:
        """What the forward of prompt[begin:end] takes of the images; None if none (its
        tokens turn as the KV cache's shifts say)."""
        groups = torch.full((end - begin,), -1, dtype=torch.long)
        embeds = []
        for index, (a, b) in enumerate(self.spans()):
            if begin <= a and b <= end:
                groups[a - begin : b - begin] = index
                embeds.append(self.embeds[index])
            elif a < end and begin < b:
                raise ValueError(f"a forward of tokens {begin}..{end} splits image {index}")
        if not embeds:
            return None
        rope = self.rope[:, begin:end]
        shift = int(self.rope[:, :end].max()) + 1 - end
        return MRopeImages(torch.cat(embeds).to(device), groups.to(device), rope, shift)

    def shift_at(self, position: int) -> int:
        """How far the M-RoPE position of a text token at `position` lies before its place
        (the images before it make it): at a text place of the prompt, or after it."""
        length = self.rope.shape[1]
        if position < length:
            return int(self.rope[0, position]) - position
        return int(self.rope.max()) + 1 - length


def _token_ids(tokenizer: Tokenizer, markers: tuple[str, str, str], family: str) -> int:
    """The id of the image pad (the middle of `markers`), where the tokenizer has all
    three vision tokens (else it is not `family`'s)."""
    missing = [text for text in markers if tokenizer.token_id(text) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not {family}'s")
    return tokenizer.token_id(markers[1])


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    markers: tuple[str, str, str] = (VISION_START, IMAGE_PAD, VISION_END),
    family: str = "Qwen2-VL",
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each image pad (<|image_pad|>, the middle of `markers`: the
    vision tokens of `family`'s tokenizer) repeated once per merged token of the image
    `encoded` (encode's tokens) in order, and the images as generate() takes them. The
    text must mark exactly as many places as there are images."""
    pad_text = markers[1]
    pad = _token_ids(tokenizer, markers, family)
    places = text.count(pad_text)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({pad_text}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write "
            f"{''.join(markers)} where each goes"
        )
    grids = [(int(e.shape[0]), int(e.shape[1])) for e in encoded]
    pieces = text.split(pad_text)
    expanded = pieces[0] + "".join(
        pad_text * (rows * columns) + piece
        for (rows, columns), piece in zip(grids, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
    if len(starts) != len(encoded) or ids.count(pad) != sum(r * c for r, c in grids):
        raise UsageError(f"the prompt holds {pad_text} of its own: remove it")
    embeds = [e.flatten(0, 1) for e in encoded]
    rope = rope_index(len(ids), starts, grids)
    return ids, QwenPromptImages(embeds, starts, rope)


def omni_prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """prompt for Qwen2.5-Omni, whose tokenizer names the vision tokens OMNI_MARKERS."""
    return prompt(tokenizer, text, encoded, OMNI_MARKERS, "Qwen2.5-Omni")
