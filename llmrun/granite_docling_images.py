"""Prompts with images, for Granite Docling (granite-for-docling-500m's architecture): each
page cut into square tiles as GraniteDoclingImageProcessor's Pillow backend cuts it (the
GOT-OCR2 grid whose aspect is nearest the page's, at most 16 tiles a side, the page resized
onto it, plus a thumbnail of the whole page where there are several tiles; a wider tile
budget for a page the spread rule selects), encoded (llmrun.models.granite_docling_vision:
each token its features and DeepStack features side by side), and each image place that
the chat template marks (<image>) expanded as GraniteDoclingProcessor expands it: per tile
<fake_token_around_image><row_R_col_C> and its <image> tokens, a newline after each row of
tiles, then, where there are several, a newline and <fake_token_around_image><global-img>,
the thumbnail's <image> tokens and <fake_token_around_image>. Unlike Idefics3's
(llmrun.idefics3_images), a page of one tile keeps its row and column marker and has no
thumbnail. An image's span runs from its first <image> to its last; the markers inside it
take the language model's own embeddings (llmrun.models.granite_docling_text), so their
rows are zeros here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.idefics3_images import FAKE, GLOBAL, IMAGE
from llmrun.images import normalized
from llmrun.internvl_images import tile_grid as canvas
from llmrun.loading.granite_docling_vision import GraniteDoclingVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

MAX_SIDE = 16  # the tokenizer's <row_R_col_C> markers go up to 16 x 16


@dataclass(frozen=True)
class TiledPage:
    """A page's tokens [tiles * tile tokens, (1 + K) * hidden], its tiles row by row
    then the thumbnail, and its grid of tiles."""

    tokens: torch.Tensor
    rows: int
    columns: int

    @property
    def tile_tokens(self) -> int:
        """The <image> tokens of each tile (and of the thumbnail)."""
        tiles = self.rows * self.columns
        return len(self.tokens) // (tiles + 1 if tiles > 1 else 1)


def _budget(vision: GraniteDoclingVision, height: int, width: int) -> int:
    """The most tiles a page may take (get_page_max_patches): dense_max_tiles where the
    spread rule selects it (too shrunk at max_tiles and wide enough), else max_tiles."""
    if not vision.crop or vision.max_tiles <= 1:
        return 1
    limit = vision.max_tiles
    if not vision.dense_max_tiles or (vision.dense_max_scale <= 0 and vision.dense_min_aspect <= 0):
        return limit
    aspect = width / height
    if vision.dense_min_aspect > 0 and not aspect > vision.dense_min_aspect:
        return limit
    if vision.dense_max_aspect > 0 and aspect > vision.dense_max_aspect:
        return limit
    if vision.dense_max_scale > 0:
        columns, _ = canvas(height, width, vision.tile, vision.min_tiles, limit, MAX_SIDE)
        if not columns * vision.tile / width < vision.dense_max_scale:
            return limit
    return vision.dense_max_tiles


def tile_grid(vision: GraniteDoclingVision, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) of tiles a page of height x width is cut into."""
    budget = _budget(vision, height, width)
    if budget <= 1:
        return 1, 1
    columns, rows = canvas(
        height, width, vision.tile, min(vision.min_tiles, budget), budget, MAX_SIDE
    )
    return rows, columns


def pixel_values(vision: GraniteDoclingVision, image) -> tuple[torch.Tensor, tuple[int, int]]:
    """Float32 tiles [n, 3, tile, tile] of an RGB Pillow image as the Pillow backend makes
    them: the page resized onto its grid and cut row by row, then the whole page resized to
    one tile where the grid has several; each / 255, (x - mean) / std. And the grid."""
    size = vision.tile
    rows, columns = tile_grid(vision, image.height, image.width)
    resized = image.resize((size * columns, size * rows), vision.resample)
    tiles = [
        resized.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
        for r in range(rows)
        for c in range(columns)
    ]
    if len(tiles) > 1:
        tiles.append(image.resize((size, size), vision.resample))
    pixels = torch.stack([normalized(t, vision.mean, vision.std) for t in tiles])
    return pixels, (rows, columns)


@torch.inference_mode()
def encode(vision: GraniteDoclingVision, images: Sequence) -> list[TiledPage]:
    """Each (Pillow) image's tokens, encoded one image at a time."""
    out = []
    for image in images:
        pixels, (rows, columns) = pixel_values(vision, image)
        tokens = vision.encoder(pixels, fine=vision.fine).flatten(0, 1)
        out.append(TiledPage(tokens, rows, columns))
    return out


def expansion(rows: int, columns: int, tokens: int) -> str:
    """The text in place of a page of rows x columns tiles of `tokens` <image> tokens
    each (GraniteDoclingProcessor.replace_image_token)."""
    tile = IMAGE * tokens
    text = "".join(
        "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(columns)) + "\n"
        for r in range(rows)
    )
    if rows * columns > 1:
        text += f"\n{FAKE}{GLOBAL}{tile}{FAKE}"
    return text


def image_tokens(vision: GraniteDoclingVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it: its
    expansion's, each newline counted as one token (at most one too many, where the
    vocabulary has "\\n\\n" as one)."""
    rows, columns = tile_grid(vision, image.height, image.width)
    tiles = rows * columns * (vision.tile_tokens + 2) + rows
    return tiles if rows * columns == 1 else tiles + 1 + vision.tile_tokens + 3


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[TiledPage]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> expanded for the page `encoded` (encode's) in
    order, and the images as generate() takes them: each one's span from its first
    <image> to its last, its tokens in the <image> places (zeros between). The text must
    mark exactly as many places as there are images."""
    missing = [t for t in (FAKE, IMAGE, GLOBAL) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Granite Docling's")
    image = tokenizer.token_id(IMAGE)
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        expansion(e.rows, e.columns, e.tile_tokens) + piece
        for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    where = [i for i, t in enumerate(ids) if t == image]
    if len(where) != sum(len(e.tokens) for e in encoded):
        raise UsageError(f"the prompt holds {IMAGE} of its own: remove it")
    starts, embeds, done = [], [], 0
    for e in encoded:
        first, last = where[done], where[done + len(e.tokens) - 1]
        done += len(e.tokens)
        span = ids[first : last + 1]
        rows = e.tokens.new_zeros(len(span), e.tokens.shape[1])
        rows[torch.tensor([t == image for t in span])] = e.tokens
        starts.append(first)
        embeds.append(rows)
    return ids, PromptImages(embeds, starts)
