"""Prompts with images, for InternVL: each image cut into tiles as transformers'
GotOcr2ImageProcessor does for InternVLProcessor (a grid of 1 to 12 square tiles whose
aspect is nearest the image's, the image resized bicubically onto it, plus a thumbnail of
the whole image where there are several tiles), encoded (llmrun.models.internvl_vision),
and each image place that the chat template marks (<IMG_CONTEXT>) expanded as
InternVLProcessor expands it: <img>, an <IMG_CONTEXT> per soft token of every tile, </img>.
An image's embeddings take its <IMG_CONTEXT>s' places: one span per image. Qianfan-OCR's
(QianfanOCRProcessor) expand alike, but its chat template marks an image's place by its
placeholder (<image>).

llama.cpp (tools/mtmd, mtmd_image_preprocessor_internvl) tiles otherwise: an image no
larger than a tile is one tile, resized; a larger one takes the grid of least wasted area
at the most kept resolution (llava-uhd's select_best_resolution), not the nearest aspect.
llmrun tiles as transformers does for both formats, as the models were trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.internvl_vision import InternVLVision, QianfanOcrVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE_START, IMAGE_CONTEXT, IMAGE_END = "<img>", "<IMG_CONTEXT>", "</img>"


@lru_cache(maxsize=16)
def _arrangements(
    min_tiles: int, max_tiles: int, max_side: int | None
) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) of min_tiles..max_tiles tiles (and at most max_side a side),
    fewest tiles first (get_all_supported_aspect_ratios)."""
    side = max_tiles if max_side is None else min(max_tiles, max_side)
    grids = [
        (columns, rows)
        for columns in range(1, side + 1)
        for rows in range(1, side + 1)
        if min_tiles <= columns * rows <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def tile_grid(
    height: int,
    width: int,
    tile: int,
    min_tiles: int,
    max_tiles: int,
    max_side: int | None = None,
) -> tuple[int, int]:
    """The (columns, rows) of tiles an image is cut into: the arrangement whose aspect is
    nearest the image's; of equally near ones, the later (more tiles) while the image's
    area is over half theirs (get_optimal_tiled_canvas). Granite Docling's pages take at
    most `max_side` tiles a side."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in _arrangements(min_tiles, max_tiles, max_side):
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


def tile_count(vision: InternVLVision, height: int, width: int) -> int:
    """How many tiles an image of height x width takes: its grid's, and a thumbnail where
    there are several (get_number_of_image_patches)."""
    if vision.max_tiles == 1:
        return 1
    columns, rows = tile_grid(height, width, vision.tile, vision.min_tiles, vision.max_tiles)
    return 1 if columns * rows == 1 else columns * rows + 1


def pixel_values(vision: InternVLVision, image) -> torch.Tensor:
    """Float32 tiles [n, 3, tile, tile] of an RGB Pillow image, as GotOcr2ImageProcessor's
    Pillow backend makes them with crop_to_patches: the image resized bicubically to its
    grid of tiles, cut row by row, then the whole image resized to one tile where the grid
    has several; each / 255, (x - mean) / std."""
    from PIL import Image

    size = vision.tile
    if vision.max_tiles == 1:
        columns, rows = 1, 1
    else:
        columns, rows = tile_grid(
            image.height, image.width, size, vision.min_tiles, vision.max_tiles
        )
    bicubic = Image.Resampling.BICUBIC
    resized = image.resize((size * columns, size * rows), bicubic)
    tiles = [
        resized.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
        for r in range(rows)
        for c in range(columns)
    ]
    if len(tiles) > 1:
        tiles.append(image.resize((size, size), bicubic))
    return torch.stack([normalized(t, vision.mean, vision.std) for t in tiles])


def image_tokens(vision: InternVLVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes: <img>, its tiles' soft tokens and
    </img>, known before encoding it."""
    return tile_count(vision, image.height, image.width) * vision.tokens_per_tile + 2


@torch.inference_mode()
def encode(vision: InternVLVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tiles * tokens per tile, hidden], its tiles in
    order (the thumbnail last), encoded one image at a time."""
    return [vision.encoder(pixel_values(vision, image)).flatten(0, 1) for image in images]


def _token_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    texts = (IMAGE_START, IMAGE_CONTEXT, IMAGE_END)
    ids = [tokenizer.token_id(text) for text in texts]
    missing = [t for t, i in zip(texts, ids, strict=True) if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not InternVL's")
    return ids[0], ids[1], ids[2]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor], place: str = IMAGE_CONTEXT
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each image place (`place`: <IMG_CONTEXT>) expanded for the
    image `encoded` (encode's tokens) in order, and the images as generate() takes them.
    The text must mark exactly as many places as there are images."""
    start, context, end = _token_ids(tokenizer)
    places = text.count(place)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({place}) "
            f"for {len(encoded)} image{'s' * (len(encoded) != 1)}: write {place} "
            "where each goes"
        )
    pieces = text.split(place)
    expanded = pieces[0] + "".join(
        f"{IMAGE_START}{IMAGE_CONTEXT * len(e)}{IMAGE_END}{piece}"
        for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == context and (i == 0 or ids[i - 1] != context)]
    held = [ids.count(t) for t in (start, context, end)]
    expected = [len(encoded), sum(len(e) for e in encoded), len(encoded)]
    if len(starts) != len(encoded) or held != expected:
        raise UsageError(
            f"the prompt holds {IMAGE_START}, {IMAGE_CONTEXT} or {IMAGE_END} of its own: remove it"
        )
    return ids, PromptImages(list(encoded), starts)


def qianfan_prompt(
    vision: QianfanOcrVision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """prompt for Qianfan-OCR, whose image places are its placeholder."""
    return prompt(tokenizer, text, encoded, vision.placeholder)
