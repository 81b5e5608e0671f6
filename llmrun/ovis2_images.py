"""Prompts with images, for Ovis2: each image cut into square tiles as transformers'
Ovis2ImageProcessorPil cuts it (where its crop_to_patches is on: the fewest tiles of a
grid that cover 90% of the image, or the grid closest to its aspect, and a thumbnail of
the whole image first when there is more than one tile), encoded
(llmrun.models.ovis2_vision), and each <image> of the prompt expanded as Ovis2Processor
expands it: <IMG_START>, the first tile's <IMG_ATOM>s, <IMG_GRID>, then where there are
several tiles each tile's <IMG_ATOM>s with <IMG_COL> between the tiles of a row and
<IMG_ROW> between rows, <IMG_END>. The <IMG_ATOM>s take the tiles' tokens in order, the
other markers the visual embedding table's indicator rows (by the config's
visual_indicator_token_ids), so an image's span of PromptImages runs from <IMG_START> to
<IMG_END>; the language model turns every token by its place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.ovis2_vision import Ovis2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

PLACE = "<image>"
START, ATOM, GRID, COL, ROW, END = (
    "<IMG_START>",
    "<IMG_ATOM>",
    "<IMG_GRID>",
    "<IMG_COL>",
    "<IMG_ROW>",
    "<IMG_END>",
)
COVERING_THRESHOLD = 0.9  # Ovis2ImageProcessor's


@lru_cache(maxsize=16)
def _grids(least: int, most: int) -> list[tuple[int, int]]:
    """Every (a, b) of least..most tiles, a outer and b inner, by tile count (stable)."""
    grids = [
        (a, b) for a in range(1, most + 1) for b in range(1, most + 1) if least <= a * b <= most
    ]
    return sorted(grids, key=lambda g: g[0] * g[1])


def _covered(left: int, upper: int, right: int, lower: int, side: int) -> float:
    """The area of a region a side x side tile keeps when the region's long side is scaled
    down to the tile's."""
    long, short = max(right - left, lower - upper), min(right - left, lower - upper)
    if long > side:
        short, long = short / long * side, side
    return long * short


def covering_grid(height: int, width: int, side: int, most: int) -> tuple[int, int]:
    """Ovis2ImageProcessor's get_min_tile_covering_grid: the grid (a, b) of the fewest tiles
    whose regions (a rows of b, cut as split_image_into_grid cuts them) keep more than
    COVERING_THRESHOLD of the image at tile size, the better covering first among equals;
    else the best covering, the fewest tiles first."""
    evaluated = []
    for grid in _grids(1, most):
        rows, cols = grid
        row_height, col_width = height // rows, width // cols
        area = sum(
            _covered(
                c * col_width,
                r * row_height,
                width if c == cols - 1 else (c + 1) * col_width,
                height if r == rows - 1 else (r + 1) * row_height,
                side,
            )
            for r in range(rows)
            for c in range(cols)
        )
        evaluated.append((grid, area / (height * width)))
    enough = [e for e in evaluated if e[1] > COVERING_THRESHOLD]
    if enough:
        return min(enough, key=lambda e: (e[0][0] * e[0][1], -e[1]))[0]
    return min(evaluated, key=lambda e: (-e[1], e[0][0] * e[0][1]))[0]


def closest_grid(height: int, width: int, side: int, least: int, most: int) -> tuple[int, int]:
    """Ovis2ImageProcessor's get_optimal_tiled_canvas: the grid (columns, rows) whose
    aspect is closest to the image's, a later equal one where the image is over half its
    area."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for grid in _grids(least, most):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and width * height > 0.5 * side * side * grid[0] * grid[1]:
            best = grid
    return best


def tile_grid(vision: Ovis2Vision, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) of tiles an image is cut into."""
    side = vision.encoder.args.image_size
    if not vision.crop_to_patches or vision.max_patches <= 1:
        return 1, 1
    if vision.use_covering_area_grid:
        # The processor reads the covering grid's (a, b) as (columns, rows).
        columns, rows = covering_grid(height, width, side, vision.max_patches)
    else:
        columns, rows = closest_grid(height, width, side, vision.min_patches, vision.max_patches)
    return rows, columns


def pixel_tiles(image, vision: Ovis2Vision) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image as Ovis2ImageProcessorPil makes it: its tiles [T, 3, S, S]
    (the thumbnail first where there are several tiles; each resized bicubically, / 255,
    (x - mean) / std), and the grid's rows and columns."""
    from PIL import Image

    side = vision.encoder.args.image_size
    rows, columns = tile_grid(vision, image.height, image.width)
    bicubic = Image.Resampling.BICUBIC
    if rows * columns == 1:
        tiles = [image.resize((side, side), bicubic)]
    else:
        canvas = image.resize((side * columns, side * rows), bicubic)
        tiles = [image.resize((side, side), bicubic)] + [
            canvas.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
            for r in range(rows)
            for c in range(columns)
        ]
    pixels = torch.stack([normalized(tile, vision.mean, vision.std) for tile in tiles])
    return pixels, rows, columns


def _tiles(rows: int, columns: int) -> int:
    return rows * columns + (rows * columns > 1)


def image_tokens(vision: Ovis2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes: every tile's tokens and the
    markers between and around them."""
    rows, columns = tile_grid(vision, image.height, image.width)
    markers = 3 + (rows * (columns - 1) + rows - 1 if rows * columns > 1 else 0)
    return _tiles(rows, columns) * vision.encoder.args.tokens_per_tile + markers


@dataclass
class EncodedImage:
    """An image's tiles' tokens [tiles, tokens_per_tile, hidden] and its grid."""

    tokens: torch.Tensor
    rows: int
    columns: int


@torch.inference_mode()
def encode(vision: Ovis2Vision, images: Sequence) -> list[EncodedImage]:
    """Each (Pillow) image's tiles' tokens, encoded one image at a time."""
    out = []
    for image in images:
        tiles, rows, columns = pixel_tiles(image, vision)
        out.append(EncodedImage(vision.encoder(tiles), rows, columns))
    return out


def placeholder(image: EncodedImage) -> str:
    """The text Ovis2Processor puts in an <image>'s place."""
    atoms = ATOM * image.tokens.shape[1]
    text = START + atoms + GRID
    if image.rows * image.columns > 1:
        text += ROW.join(COL.join([atoms] * image.columns) for _ in range(image.rows))
    return text + END


def prompt(
    vision: Ovis2Vision, tokenizer: Tokenizer, text: str, encoded: Sequence[EncodedImage]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> expanded for the image `encoded` (encode's) in
    order, and the images (their markers' embeddings with them) as generate() takes them.
    The text must mark exactly as many places as there are images."""
    missing = [t for t in (START, ATOM, GRID, COL, ROW, END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Ovis2's")
    if tokenizer.token_id(ATOM) != vision.image_token_id:
        raise TokenizerError(
            f"the tokenizer's {ATOM} is not the config's image_token_id "
            f"{vision.image_token_id}: not this Ovis2's"
        )
    places = text.count(PLACE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({PLACE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {PLACE} where each goes"
        )
    pieces = text.split(PLACE)
    ids = tokenizer.encode(
        pieces[0] + "".join(placeholder(e) + p for e, p in zip(encoded, pieces[1:], strict=True))
    )
    start, end = tokenizer.token_id(START), tokenizer.token_id(END)
    starts = [i for i, t in enumerate(ids) if t == start]
    ends = [i for i, t in enumerate(ids) if t == end]
    if len(starts) != len(encoded) or len(ends) != len(encoded):
        raise UsageError(f"the prompt holds {START} or {END} of its own")
    indicators = vision.encoder.indicators()
    marker = {token: indicators[i] for i, token in enumerate(vision.indicator_token_ids)}
    embeds = []
    for image, first, last in zip(encoded, starts, ends, strict=True):
        atoms = iter(image.tokens.flatten(0, 1))
        span = ids[first : last + 1]
        if span.count(vision.image_token_id) != image.tokens.shape[0] * image.tokens.shape[1]:
            raise UsageError(f"the prompt holds {ATOM} of its own")
        unknown = {t for t in span if t != vision.image_token_id and t not in marker}
        if unknown:
            raise TokenizerError(
                f"the tokenizer's image markers {sorted(unknown)} are not among the "
                "config's visual_indicator_token_ids: not this Ovis2's"
            )
        embeds.append(
            torch.stack([next(atoms) if t == vision.image_token_id else marker[t] for t in span])
        )
    return ids, PromptImages(embeds, starts)
