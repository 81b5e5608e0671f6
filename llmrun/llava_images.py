"""Prompts with images, for LLaVA 1.5 and LLaVA-NeXT (1.6): each image prepared as
transformers' image processors do (their Pillow backends), encoded
(llmrun.models.llava_vision), and each image place that the chat template marks (<image>)
expanded as LlavaProcessor / LlavaNextProcessor expand it: one <image> per soft token.

LLaVA 1.5 (LlavaImageProcessor, CLIPImageProcessor): optionally padded to a square of the
mean colour, resized so its shorter side is `size`, centre-cropped to the tower's square.
LLaVA-NeXT (LlavaNextImageProcessor, "anyres"): the grid pinpoint (a resolution) that keeps
most of the image with least waste; the image resized into it keeping its aspect, padded
with black to it and cut into tiles, after a base tile of the whole image squashed square.
Its features (modeling_llava_next.pack_image_features): the base tile's patches, then the
tiles' patches as one grid with the padding's rows or columns cut away, each row followed
by the learned image_newline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.llava_vision import LlavaVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<image>"


def best_resolution(
    height: int, width: int, pinpoints: Sequence[tuple[int, int]]
) -> tuple[int, int]:
    """The (height, width) of the pinpoint that keeps most of an image's pixels, of equal
    ones the least wasted (select_best_resolution)."""
    best, most, least_waste = pinpoints[0], 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > most or (kept == most and waste < least_waste):
            best, most, least_waste = (h, w), kept, waste
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) an image is resized to within a pinpoint, keeping its aspect
    (get_patch_output_size)."""
    target_h, target_w = target
    # The scale first, then the product, as transformers rounds: 200 * (1008 / 900) > 224.
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def unpadded_grid(height: int, width: int, rows: int, columns: int) -> tuple[int, int]:
    """The (rows, columns) of a rows x columns feature grid left once the padding that
    fitted an image of height x width into it is cut away (unpad_image)."""
    if width / height > columns / rows:
        kept = int(round(height * (columns / width), 7))
        return rows - (rows - kept) // 2 * 2, columns
    kept = int(round(width * (rows / height), 7))
    return rows, columns - (columns - kept) // 2 * 2


def _resized(vision: LlavaVision, image):
    """An image resized and centre-cropped as the processor's `size` and `crop_size` say."""
    size = vision.size
    if isinstance(size, int):  # the shorter side to `size`
        short, long = sorted((image.width, image.height))
        other = int(size * long / short)
        width, height = (size, other) if image.width <= image.height else (other, size)
    else:
        height, width = size
    if image.size != (width, height):
        image = image.resize((width, height), vision.resample)
    if vision.crop is not None:
        crop_h, crop_w = vision.crop
        top, left = (image.height - crop_h) // 2, (image.width - crop_w) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
    return image


def _padded_square(vision: LlavaVision, image):
    """LlavaImageProcessor's pad_to_square: the image centred on a square of the mean colour."""
    from PIL import Image

    if image.width == image.height:
        return image
    side = max(image.size)
    colour = tuple(int(m * 255) for m in vision.mean)
    square = Image.new("RGB", (side, side), colour)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


def tiles(vision: LlavaVision, image) -> list:
    """The Pillow tiles of an RGB image, before normalization: LLaVA 1.5's one, or
    LLaVA-NeXT's base tile and its pinpoint's tiles row by row."""
    from PIL import Image

    if vision.pinpoints is None:
        return [_resized(vision, _padded_square(vision, image) if vision.pad else image)]
    best = best_resolution(image.height, image.width, vision.pinpoints)
    height, width = fitted_size(image.height, image.width, best)
    canvas = Image.new("RGB", (best[1], best[0]), (0, 0, 0))
    resized = image.resize((width, height), vision.resample)
    canvas.paste(resized, ((best[1] - width) // 2, (best[0] - height) // 2))
    side = vision.tile
    base = image.resize((vision.base[1], vision.base[0]), vision.resample)
    cut = [
        canvas.crop((x, y, x + side, y + side))
        for y in range(0, best[0], side)
        for x in range(0, best[1], side)
    ]
    return [_resized(vision, t) for t in [base, *cut]]


def pixel_values(vision: LlavaVision, image) -> torch.Tensor:
    """Float32 tiles [n, 3, S, S] of an RGB Pillow image, as the processor makes them."""
    return torch.stack([normalized(t, vision.mean, vision.std) for t in tiles(vision, image)])


def _grid(vision: LlavaVision, height: int, width: int) -> tuple[int, int, int, int]:
    """LLaVA-NeXT's tile grid (rows, columns) for an image, and its feature grid's
    (rows, columns) once unpadded."""
    best = best_resolution(height, width, vision.pinpoints)
    rows, columns = best[0] // vision.image_size, best[1] // vision.image_size
    side = vision.encoder.args.vision.patches_per_side
    return rows, columns, *unpadded_grid(height, width, rows * side, columns * side)


def image_tokens(vision: LlavaVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    per_tile = vision.encoder.args.vision.patches_per_side**2
    if vision.pinpoints is None:
        return per_tile
    _, _, rows, columns = _grid(vision, image.height, image.width)
    return per_tile + rows * (columns + 1)


def pack(vision: LlavaVision, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """LLaVA-NeXT's soft tokens [tokens, hidden] of an image of height x width from its
    tiles' features [1 + tiles, patches, hidden] (pack_image_features)."""
    tile_rows, tile_columns, rows, columns = _grid(vision, height, width)
    side = vision.encoder.args.vision.patches_per_side
    hidden = features.shape[-1]
    # [tiles, side², hidden] -> [tile rows, side, tile columns, side, hidden] -> one grid
    grid = features[1:].view(tile_rows, tile_columns, side, side, hidden).permute(0, 2, 1, 3, 4)
    grid = grid.reshape(tile_rows * side, tile_columns * side, hidden)
    top = (grid.shape[0] - rows) // 2
    left = (grid.shape[1] - columns) // 2
    grid = grid[top : top + rows, left : left + columns]
    newline = vision.encoder.image_newline.expand(rows, 1, hidden)
    return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])


@torch.inference_mode()
def encode(vision: LlavaVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tokens, hidden], encoded one image at a time."""
    out = []
    for image in images:
        features = vision.encoder(pixel_values(vision, image))
        if vision.pinpoints is None:
            out.append(features[0])
        else:
            out.append(pack(vision, features, image.height, image.width))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> repeated once per soft token of the image
    `encoded` in order, and the images as generate() takes them. The text must mark exactly
    as many places as there are images."""
    image = tokenizer.token_id(IMAGE)
    if image is None:
        raise TokenizerError(f"the tokenizer has no {IMAGE}: not LLaVA's")
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        IMAGE * len(e) + piece for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts, index = [], 0
    for e in encoded:  # images side by side make one run of <image>s
        while index < len(ids) and ids[index] != image:
            index += 1
        starts.append(index)
        index += len(e)
    runs = zip(starts, encoded, strict=True)
    whole = all(ids[s : s + len(e)] == [image] * len(e) for s, e in runs)
    if not whole or ids.count(image) != sum(len(e) for e in encoded):
        raise TokenizerError(f"{IMAGE} in the text does not encode as the tokenizer's {IMAGE}")
    return ids, PromptImages(list(encoded), starts)
