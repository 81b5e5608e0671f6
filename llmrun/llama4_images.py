"""Prompts with images, for Llama 4: each image cut into tiles as transformers'
Llama4ImageProcessor does (the grid of at most max_patches square tiles that needs the
least scaling, the image resized onto it without distortion, never enlarged past one tile
a side unless resize_to_max_canvas, padded with black at the right and bottom, plus the
whole image squeezed into one more tile where there are several), encoded
(llmrun.models.llama4_vision), and each image place that the chat template marks
(<|image|>) expanded as Llama4Processor expands it: <|image_start|>, each row of tiles'
<|patch|> tokens with <|tile_x_separator|> between tiles and <|tile_y_separator|> after
the row, then <|image|>, the whole image's <|patch|> tokens and <|image_end|> (an image of
one tile: <|image_start|><|image|>, its <|patch|> tokens, <|image_end|>). An image's span
runs from its first <|patch|> to its last; the text tokens inside it take the language
model's own embeddings, as transformers embeds them.

Resizing is bilinear and antialiased on the uint8 pixels (torch's, which the processor's
torchvision backend calls); pixels are scaled and normalized in bfloat16, as the processor
does after Meta's original code. llama.cpp (tools/mtmd: llava-uhd slicing, clip.cpp)
prepares Llama 4's images otherwise: grids of at most 3x3 tiles chosen as llava-uhd
chooses, its own bilinear filter, float32 pixels; no separators and no <|image|> between
the tiles and the whole image; and its pixel shuffle leaves each tile's tokens column by
column. llmrun follows transformers for both formats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.llama4_vision import Llama4Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

START, END, IMAGE, PATCH = "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"


@dataclass(frozen=True)
class EncodedImage:
    """An image's soft tokens [frames, tokens per tile, hidden] (its tiles row by row, then
    the whole image; or its one tile) and its grid of tiles (rows, columns)."""

    tokens: torch.Tensor
    grid: tuple[int, int]


@lru_cache(maxsize=16)
def supported_grids(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (rows, columns) of at most max_tiles tiles, in the order
    find_supported_resolutions lists them (grouped by aspect, most tiles first), which
    decides between equally good ones."""
    by_aspect: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_aspect.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple(grid for grids in by_aspect.values() for grid in grids)


def _canvas(vision: Llama4Vision, height: int, width: int) -> torch.Tensor:
    """The (height, width) in pixels of the grid an image is resized onto (get_best_fit):
    of the grids that fit it whole by scaling up, the least scaling (the most, with
    resize_to_max_canvas); else the least scaling down; of those, the smallest area."""
    grids = torch.tensor(supported_grids(vision.max_tiles)) * vision.tile
    # In float32, as the processor compares them.
    scales = torch.minimum(grids[:, 1] / width, grids[:, 0] / height)
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if vision.resize_to_max_canvas else up.min()
    else:
        chosen = scales[scales < 1].max()
    candidates = grids[scales == chosen]
    return candidates[torch.argmin(candidates[:, 0] * candidates[:, 1])]


def tile_grid(vision: Llama4Vision, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) of tiles an image is resized onto."""
    canvas = _canvas(vision, height, width)
    return int(canvas[0]) // vision.tile, int(canvas[1]) // vision.tile


def resized_size(vision: Llama4Vision, height: int, width: int) -> tuple[int, int]:
    """The (height, width) an image is resized to within its grid, the aspect kept
    (get_max_res_without_distortion), not past one tile a side where it was smaller
    unless resize_to_max_canvas. Python numbers where the processor has them, float32
    tensors where it has those (a side of the grid), so that floor() rounds alike."""
    target_height, target_width = _canvas(vision, height, width)
    if not vision.resize_to_max_canvas:
        target_height = min(max(height, vision.tile), target_height)
        target_width = min(max(width, vision.tile), target_width)
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        new_height, new_width = min(math.floor(height * scale_w), target_height), target_width
    else:
        new_height, new_width = target_height, min(math.floor(width * scale_h), target_width)
    return max(int(new_height), 1), max(int(new_width), 1)


def _normalized(vision: Llama4Vision, pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [..., 3, H, W] scaled and normalized in bfloat16 (the processor's
    rescale_and_normalize), as float32."""
    x = pixels.to(torch.bfloat16) * vision.rescale_factor
    mean = torch.tensor(vision.mean, dtype=torch.bfloat16)[:, None, None]
    std = torch.tensor(vision.std, dtype=torch.bfloat16)[:, None, None]
    return ((x - mean) / std).float()


def _resized(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 pixels [1, 3, H, W] resized bilinearly, antialiased, as torchvision's resize."""
    return F.interpolate(pixels, size=(height, width), mode="bilinear", antialias=True)


def pixel_values(vision: Llama4Vision, image) -> tuple[torch.Tensor, tuple[int, int]]:
    """Float32 frames [n, 3, tile, tile] of an RGB Pillow image as Llama4ImageProcessor
    makes them (its tiles row by row, then the whole image where there are several), and
    its grid (rows, columns)."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    rows, columns = tile_grid(vision, image.height, image.width)
    tile = vision.tile
    canvas = torch.zeros(1, 3, rows * tile, columns * tile, dtype=torch.uint8)
    height, width = resized_size(vision, image.height, image.width)
    canvas[..., :height, :width] = _resized(pixels, height, width)
    # [1, 3, rows * tile, columns * tile] -> [rows * columns, 3, tile, tile], row by row
    tiles = (
        canvas.view(3, rows, tile, columns, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
    )
    if rows * columns > 1:
        tiles = torch.cat([tiles, _resized(pixels, tile, tile)])
    return _normalized(vision, tiles), (rows, columns)


def expansion(rows: int, columns: int, tokens: int) -> str:
    """The text in place of an image of rows x columns tiles of `tokens` soft tokens each
    (Llama4Processor._prompt_split_image)."""
    text = START
    if rows * columns > 1:
        row = TILE_X.join([PATCH * tokens] * columns) + TILE_Y
        text += row * rows
    return f"{text}{IMAGE}{PATCH * tokens}{END}"


def image_tokens(vision: Llama4Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    rows, columns = tile_grid(vision, image.height, image.width)
    tokens = vision.tokens_per_tile
    if rows * columns == 1:
        return tokens + 3
    return rows * columns * tokens + rows * columns + tokens + 3


@torch.inference_mode()
def encode(vision: Llama4Vision, images: Sequence) -> list[EncodedImage]:
    """Each (Pillow) image's soft tokens, its tiles and the whole image encoded together
    (each tile's patches attend to each other only)."""
    out = []
    for image in images:
        frames, grid = pixel_values(vision, image)
        out.append(EncodedImage(vision.encoder(frames), grid))
    return out


def _ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """The ids of <|image|> and <|patch|>, where the tokenizer has Llama 4's image tokens."""
    texts = (START, END, IMAGE, PATCH, TILE_X, TILE_Y)
    missing = [t for t in texts if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Llama 4's")
    return tokenizer.token_id(IMAGE), tokenizer.token_id(PATCH)


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[EncodedImage],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image|> expanded for the image `encoded` (encode's) in
    order, and the images as generate() takes them: each one's span from its first
    <|patch|> to its last, the soft tokens in the <|patch|> places and the embeddings
    (`embed_token(id)`, [hidden]) of the separators and <|image|> between them. The text
    must mark exactly as many places as there are images."""
    image, patch = _ids(tokenizer)
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        expansion(*e.grid, e.tokens.shape[1]) + piece
        for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    where = [i for i, t in enumerate(ids) if t == patch]
    counts = [e.tokens.shape[0] * e.tokens.shape[1] for e in encoded]
    if len(where) != sum(counts) or ids.count(image) != len(encoded):
        raise UsageError(f"the prompt holds {PATCH} or {IMAGE} of its own: remove it")
    starts, embeds, done = [], [], 0
    for e, count in zip(encoded, counts, strict=True):
        first, last = where[done], where[done + count - 1]
        done += count
        span = ids[first : last + 1]
        soft = e.tokens.flatten(0, 1)
        rows = torch.empty(len(span), soft.shape[1], dtype=soft.dtype)
        is_soft = torch.tensor([t == patch for t in span])
        rows[is_soft] = soft
        for i in (~is_soft).nonzero().flatten().tolist():
            rows[i] = embed_token(span[i]).to(soft.dtype)
        starts.append(first)
        embeds.append(rows)
    return ids, PromptImages(embeds, starts)
