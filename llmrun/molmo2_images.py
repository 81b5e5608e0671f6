"""Prompts with images, for Molmo 2: each image cut as transformers' Molmo2ImageProcessor
cuts it (the tiling of at most max_crops windows that needs the least upscaling, or the
least downscaling where every one is smaller; the image resized onto that canvas and cut
into square crops overlapping by the margins, and the whole image resized to one crop
first), encoded (llmrun.models.molmo2_vision: each token pools a window of patches, the
crops' overlaps left out), and each image place that the chat template marks (<|image|>)
expanded as Molmo2Processor expands it: the whole image's tokens, then the crops', each
block a start, rows of <im_patch> each closed by <im_col>, and <im_end>. The prompt
starts with BOS (EOS where the tokenizer has none) as the processor's does.

The image features are added to their <im_patch> embeddings, and every image token of
the prompt sees every other both ways (llmrun.models.molmo2_text.BlockImageTokens), so a
prefill chunk holds all of a prompt's images.

Resizing is torch's bilinear interpolation of the pixels as floats, not antialiased, then
rounded back to bytes (the processor's torchvision backend); normalizing is its fused (x -
255 mean) / (255 std) in float32.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.molmo2_vision import (
    COLUMN,
    END,
    LOW_RES_START,
    PATCH,
    PLACE,
    START,
    Molmo2Vision,
)
from llmrun.models.gemma3 import ImageTokens
from llmrun.models.molmo2_text import BlockImageTokens
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


@dataclass
class Encoded:
    """An image's tokens [tokens, text hidden] and its pooled grids: the whole image's
    (rows, columns), then the crops' together."""

    features: torch.Tensor
    grid: tuple[int, int, int, int]


@dataclass
class Molmo2PromptImages(PromptImages):
    """A Molmo 2 prompt's images: each span from its first start to its last end (zero rows
    at the markers). Every image's keys and values depend on the others', which salts their
    first block (`digest`)."""

    digest: bytes = b""

    def wholes(self) -> list[tuple[int, int]]:
        spans = self.spans()
        return [(spans[0][0], spans[-1][1])]

    def salt(self) -> bytes:
        return self.digest

    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        tokens = super().tokens(begin, end, device)
        return None if tokens is None else BlockImageTokens(tokens.embeds, tokens.groups)


def tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """The (rows, columns) of windows an image is cut into (select_tiling): each tiling's
    scale is the smaller of its height's and width's over the image's; the tiling of the
    least scale of at least 1, or where every one is under 1, the greatest; fewest windows
    first, then fewest rows."""
    tilings = [
        (rows, columns)
        for rows, columns in itertools.product(range(1, max_crops + 1), repeat=2)
        if rows * columns <= max_crops
    ]
    tilings.sort(key=lambda t: (t[0] * t[1], t[0]))
    sizes = torch.tensor(tilings, dtype=torch.int32) * window
    scales = (sizes.to(torch.float32) / torch.tensor([height, width], dtype=torch.float32)).amin(-1)
    if torch.all(scales < 1):
        return tilings[int(scales.argmax())]
    return tilings[int(torch.where(scales < 1.0, 10e9, scales).argmin())]


def geometry(vision: Molmo2Vision, height: int, width: int) -> tuple[int, int, int, int]:
    """The tiling (rows, columns) and the canvas (height, width) of an image."""
    window = (vision.crop // vision.patch - sum(vision.margins)) * vision.patch
    margin = sum(vision.margins) * vision.patch
    rows, columns = tiling(height - margin, width - margin, window, vision.max_crops)
    return rows, columns, rows * window + margin, columns * window + margin


def grid(vision: Molmo2Vision, height: int, width: int) -> tuple[int, int, int, int]:
    """The pooled grids of an image: the whole image's (rows, columns), the crops'."""
    _, _, canvas_h, canvas_w = geometry(vision, height, width)
    pool_h, pool_w = vision.pooling
    side = vision.crop // vision.patch
    return (
        -(-side // pool_h),
        -(-side // pool_w),
        -(-(canvas_h // vision.patch) // pool_h),
        -(-(canvas_w // vision.patch) // pool_w),
    )


def image_tokens(vision: Molmo2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    return len(_layout(vision, grid(vision, image.height, image.width)))


def _normalized(
    vision: Molmo2Vision, pixels: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """uint8 pixels [1, 3, H, W] resized (bilinear, as floats, rounded back to bytes) and
    normalized: float32 [3, height, width]."""
    resized = F.interpolate(pixels.float(), size=(height, width), mode="bilinear", antialias=False)
    resized = resized.round().clamp(0, 255).to(torch.uint8)[0]
    mean = (torch.tensor(vision.mean, dtype=torch.float32) * 255.0)[:, None, None]
    std = (torch.tensor(vision.std, dtype=torch.float32) * 255.0)[:, None, None]
    return (resized.float() - mean) / std


def pooling_windows(indexes: torch.Tensor, pool_h: int, pool_w: int) -> torch.Tensor:
    """A [h, w] grid of patch indexes grouped into pooling windows [rows * columns, pool_h
    * pool_w], padded with -1 evenly, the odd one after (arange_for_pooling)."""
    pad_h, pad_w = -indexes.shape[0] % pool_h, -indexes.shape[1] % pool_w
    indexes = F.pad(indexes, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2), value=-1)
    rows, columns = indexes.shape[0] // pool_h, indexes.shape[1] // pool_w
    windows = indexes.reshape(rows, pool_h, columns, pool_w).permute(0, 2, 1, 3)
    return windows.reshape(rows * columns, pool_h * pool_w)


def inputs(vision: Molmo2Vision, image) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB Pillow image's patches [crops, patches a crop, patch * patch * 3] (the whole
    image first) and its tokens' pooling windows into them [tokens, window]."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    crop, patch = vision.crop, vision.patch
    left, right = vision.margins
    side = crop // patch
    window = (side - left - right) * patch
    rows, columns, canvas_h, canvas_w = geometry(vision, image.height, image.width)
    canvas = _normalized(vision, pixels, canvas_h, canvas_w)
    # [3, rows, columns, crop, crop] -> [rows * columns, crop, crop, 3]
    crops = canvas.unfold(1, crop, window).unfold(2, crop, window)
    crops = crops.permute(1, 2, 3, 4, 0).reshape(rows * columns, crop, crop, 3)
    whole = _normalized(vision, pixels, crop, crop).permute(1, 2, 0)[None]
    crops = torch.cat([whole, crops])
    # [n, side, patch, side, patch, 3] -> [n, side * side, patch * patch * 3]
    patches = crops.reshape(-1, side, patch, side, patch, 3).transpose(2, 3)
    patches = patches.reshape(crops.shape[0], side * side, patch * patch * 3)
    # Each crop's patches by index, those in another crop's overlap -1: the canvas's grid.
    index = torch.arange(rows * columns * side * side).reshape(rows, columns, side, side)
    if left:
        index[1:, :, :left, :] = -1
        index[:, 1:, :, :left] = -1
    if right:
        index[:-1, :, -right:, :] = -1
        index[:, :-1, :, -right:] = -1
    index = index.permute(0, 2, 1, 3).reshape(-1)
    index = index[index >= 0].reshape(canvas_h // patch, canvas_w // patch)
    pool_h, pool_w = vision.pooling
    crops_pooled = pooling_windows(index, pool_h, pool_w)
    crops_pooled = torch.where(crops_pooled >= 0, crops_pooled + side * side, -1)
    whole_pooled = pooling_windows(torch.arange(side * side).reshape(side, side), pool_h, pool_w)
    return patches, torch.cat([whole_pooled, crops_pooled])


@torch.inference_mode()
def encode(vision: Molmo2Vision, images: Sequence) -> list[Encoded]:
    """Each (Pillow) image's tokens and grids, encoded one at a time."""
    out = []
    for image in images:
        patches, pooling = inputs(vision, image)
        features = vision.encoder(patches, pooling)
        out.append(Encoded(features, grid(vision, image.height, image.width)))
    return out


def _layout(vision: Molmo2Vision, grids: tuple[int, int, int, int]) -> list[str]:
    """An image's tokens as Molmo2Processor.replace_image_token lays them out."""
    low_h, low_w, high_h, high_w = grids
    low_row = [PATCH] * low_w + [COLUMN] * vision.low_res_columns
    high_row = [PATCH] * high_w + [COLUMN] * vision.columns
    first = LOW_RES_START if vision.low_res_start else START
    return [first, *low_row * low_h, END, START, *high_row * high_h, END]


def prompt(
    vision: Molmo2Vision, tokenizer: Tokenizer, text: str, encoded: Sequence[Encoded]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image|> expanded for the image `encoded` in order, after
    BOS, and the images as generate() takes them: each one's span from its first start
    token, its features in the <im_patch> places. The text must mark exactly as many places
    as there are images."""
    names = (PATCH, COLUMN, START, LOW_RES_START, END)
    ids_of = {name: tokenizer.token_id(name) for name in names}
    missing = [name for name, i in ids_of.items() if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Molmo 2's")
    if ids_of[PATCH] != vision.patch_id:
        raise TokenizerError(
            f"the tokenizer's {PATCH} is id {ids_of[PATCH]}, but the model's image_patch_id "
            f"is {vision.patch_id}"
        )
    places = text.count(PLACE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({PLACE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {PLACE} where each goes"
        )
    layouts = [_layout(vision, e.grid) for e in encoded]
    pieces = text.split(PLACE)
    expanded = pieces[0] + "".join(
        "".join(layout) + piece for layout, piece in zip(layouts, pieces[1:], strict=True)
    )
    lead = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if lead is not None and not expanded.startswith(tokenizer.token_to_piece(lead)):
        expanded = tokenizer.token_to_piece(lead) + expanded
    ids = tokenizer.encode(expanded, add_bos=False)
    starts, embeds, at = [], [], 0
    for layout, e in zip(layouts, encoded, strict=True):
        layout_ids = [ids_of[name] for name in layout]
        at = ids.index(layout_ids[0], at) if layout_ids[0] in ids[at:] else len(ids)
        if ids[at : at + len(layout_ids)] != layout_ids:
            break
        patches = torch.tensor(layout_ids) == ids_of[PATCH]
        embed = e.features.new_zeros(len(layout_ids), e.features.shape[-1])
        embed[patches] = e.features
        starts.append(at)
        embeds.append(embed)
        at += len(layout_ids)
    held = sum(ids.count(ids_of[name]) for name in names)
    if len(starts) != len(encoded) or held != sum(map(len, layouts)):
        raise UsageError(
            f"the prompt holds image tokens ({', '.join(names)}) of its own: remove them"
        )
    digest = b""
    if len(encoded) > 1:
        digest = hashlib.sha256(b"".join(e.features.numpy().tobytes() for e in encoded)).digest()
    return ids, Molmo2PromptImages(embeds, starts, digest)
