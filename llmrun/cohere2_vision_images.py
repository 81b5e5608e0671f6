"""Prompts with images, for Command A Vision: each image cut into tiles as transformers'
Cohere2VisionImageProcessor does (a grid of at most max_patches square tiles, the one
that needs the least upscaling to hold the image, or the least downscaling where every
grid is smaller; the image resized onto it, plus a thumbnail of the whole image where
there are several tiles), encoded (llmrun.models.cohere2_vision), and each image place
that the chat template marks (<|IMG_PATCH|>; the tokens are those the folder's
tokenizer_config.json names) expanded as Cohere2VisionProcessor expands it: <|START_OF_IMG|>, for each tile its soft tokens' <|IMG_PATCH|>s and an
<|IMG_LINE_BREAK|>, then <|END_OF_IMG|>. An image's span runs from its first soft token
through its last line break; the line breaks keep their own embeddings.

Resizing is on the uint8 pixels, antialiased (torch's, which the processor's torchvision
backend calls); normalizing is its fused (x - 255 mean) / (255 std) in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.cohere2_vision import BILINEAR, Cohere2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


@lru_cache(maxsize=16)
def _arrangements(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) of at most max_tiles tiles, fewest tiles first, in
    get_all_supported_aspect_ratios's order among equals."""
    grids = [
        (columns, rows)
        for columns in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if columns * rows <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def tile_grid(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """The (columns, rows) of tiles an image is cut into (get_optimal_tiled_canvas): each
    grid's scale is the smaller of its width's and height's over the image's; the grid of
    the least scale of at least 1, or where every one is under 1, the greatest; the first
    of equals."""
    grids = _arrangements(max_tiles)
    scales = [min(c * tile / width, r * tile / height) for c, r in grids]
    if all(s < 1 for s in scales):
        return grids[scales.index(max(scales))]
    upscales = [s if s >= 1 else 1e10 for s in scales]
    return grids[upscales.index(min(upscales))]


def tile_count(vision: Cohere2Vision, height: int, width: int) -> int:
    """How many tiles an image of height x width takes: its grid's, and a thumbnail where
    there are several (get_number_of_image_patches)."""
    if not vision.crop_to_patches or vision.max_tiles == 1:
        return 1
    columns, rows = tile_grid(height, width, vision.tile, vision.max_tiles)
    return 1 if columns * rows == 1 else columns * rows + 1


def _resized(vision: Cohere2Vision, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 pixels [1, 3, H, W] resized, antialiased, as torchvision's resize."""
    mode = "bilinear" if vision.resample == BILINEAR else "bicubic"
    return F.interpolate(pixels, size=(height, width), mode=mode, antialias=True)


def pixel_values(vision: Cohere2Vision, image) -> torch.Tensor:
    """Float32 tiles [n, 3, tile, tile] of an RGB Pillow image: its grid's row by row, then
    the thumbnail where there are several."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    size = vision.tile
    columns, rows = (1, 1)
    if vision.crop_to_patches and vision.max_tiles > 1:
        columns, rows = tile_grid(image.height, image.width, size, vision.max_tiles)
    grid = _resized(vision, pixels, size * rows, size * columns)[0]
    tiles = [
        grid[:, r * size : (r + 1) * size, c * size : (c + 1) * size]
        for r in range(rows)
        for c in range(columns)
    ]
    if len(tiles) > 1:
        tiles.append(_resized(vision, pixels, size, size)[0])
    mean = torch.tensor([m / (1 / 255) for m in vision.mean], dtype=torch.float32)[:, None, None]
    std = torch.tensor([s / (1 / 255) for s in vision.std], dtype=torch.float32)[:, None, None]
    return torch.stack([(t.float() - mean) / std for t in tiles])


def image_tokens(vision: Cohere2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it: a start
    and an end, and each tile's soft tokens and line break."""
    return tile_count(vision, image.height, image.width) * (vision.tile_tokens + 1) + 2


@torch.inference_mode()
def encode(vision: Cohere2Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tiles, tile tokens, hidden], the thumbnail last."""
    return [vision.encoder(pixel_values(vision, image)) for image in images]


def _token_ids(vision: Cohere2Vision, tokenizer: Tokenizer) -> list[int]:
    texts = vision.tokens
    ids = [tokenizer.token_id(text) for text in texts]
    missing = [t for t, i in zip(texts, ids, strict=True) if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Command A Vision's")
    return ids


def prompt(
    vision: Cohere2Vision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|IMG_PATCH|> (the image token vision.tokens names)
    expanded for the image `encoded` (encode's tiles) in order, and the images as
    generate() takes them: each one's span, the soft tokens in the <|IMG_PATCH|> places and
    `embed_token(id)` ([hidden]) in its line breaks'. The text must mark exactly as many
    places as there are images."""
    start_text, image_text, break_text, end_text = vision.tokens
    start, image, line_break, end = _token_ids(vision, tokenizer)
    places = text.count(image_text)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({image_text}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {image_text} where each goes"
        )
    pieces = text.split(image_text)
    expanded = pieces[0] + "".join(
        start_text + (image_text * e.shape[1] + break_text) * e.shape[0] + end_text + piece
        for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [i + 1 for i, t in enumerate(ids) if t == start]
    held = [ids.count(t) for t in (start, image, line_break, end)]
    expected = [
        len(encoded),
        sum(e.shape[0] * e.shape[1] for e in encoded),
        sum(e.shape[0] for e in encoded),
        len(encoded),
    ]
    if held != expected:
        raise UsageError(
            f"the prompt holds {start_text}, {image_text}, {break_text} or {end_text} of its "
            "own: remove it"
        )
    embeds = []
    for e in encoded:
        # [tiles, tokens + 1, hidden]: each tile's soft tokens, then its line break
        breaks = embed_token(line_break).to(e.dtype).expand(e.shape[0], 1, e.shape[2])
        embeds.append(torch.cat([e, breaks], dim=1).flatten(0, 1))
    return ids, PromptImages(embeds, starts)
