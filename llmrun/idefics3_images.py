"""Prompts with images, for SmolVLM, SmolVLM2 and Idefics3: each image resized and cut
into tiles as transformers' SmolVLMImageProcessor does (its Pillow backend), its tiles and
the whole image encoded (llmrun.models.idefics3_vision), and each image place that the
chat template marks (<image>) expanded as SmolVLMProcessor expands it: per tile
<fake_token_around_image><row_R_col_C> and its <image> tokens, a newline after each row
of tiles, then a newline and <fake_token_around_image><global-img>, the whole image's
<image> tokens and <fake_token_around_image>. An image's span runs from its first <image>
to its last; the text tokens inside it take the language model's own embeddings, as
transformers embeds them.

llama.cpp (tools/mtmd: mtmd_image_preprocessor_idefics3, MTMD_SLICE_TMPL_IDEFICS3) cuts
alike but differs: it resamples with its own Lanczos filter, puts "\\n\\n" before the
whole image as one token where the vocabulary has it, splits an image no larger than one
tile too (one tile plus the whole image; transformers gives the whole image alone), and
rounds the tile grid up from the resized size rather than from the longest side and the
aspect ratio (the same where the longest edge is a multiple of the tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.idefics3_vision import Idefics3Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
# SmolVLMImageProcessor's MAX_IMAGE_SIZE: no side over 4096 pixels after resizing.
MAX_SIDE = 4096


@dataclass(frozen=True)
class TiledImage:
    """An image's soft tokens: its tiles' [rows, columns, tokens, hidden] (rows and
    columns 0 where it was not split) and the whole image's [tokens, hidden]."""

    tiles: torch.Tensor
    whole: torch.Tensor

    @property
    def grid(self) -> tuple[int, int]:
        return self.tiles.shape[0], self.tiles.shape[1]


def resized_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """The (height, width) SmolVLMImageProcessor resizes an image to: the longest side
    to longest_edge (up or down), the other by the aspect ratio, made even, then scaled
    down to fit MAX_SIDE."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """The (height, width) in whole tiles that SmolVLMImageProcessor resizes an image to
    before cutting it (resize_for_vision_encoder): the longest side rounded up to tiles,
    the other from it by the aspect ratio, rounded up too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _grid(vision: Idefics3Vision, height: int, width: int) -> tuple[int, int]:
    """The rows and columns of tiles an image resized to height x width (resized_size)
    is cut into; (0, 0): the whole image alone."""
    if not vision.splitting:
        return 0, 0
    height, width = tiled_size(height, width, vision.tile)
    if height <= vision.tile and width <= vision.tile:
        return 0, 0
    return height // vision.tile, width // vision.tile


def _resized(vision: Idefics3Vision, height: int, width: int) -> tuple[int, int]:
    if vision.longest_edge is None:
        return height, width
    return resized_size(height, width, vision.longest_edge)


def pixel_values(vision: Idefics3Vision, image) -> tuple[torch.Tensor, tuple[int, int]]:
    """Float32 pixels [frames, 3, tile, tile] of an RGB Pillow image as
    SmolVLMImageProcessor makes them: its tiles row by row, then the whole image; and
    the rows and columns of tiles."""
    size = vision.tile, vision.tile
    height, width = _resized(vision, image.height, image.width)
    image = image.resize((width, height), vision.resample)
    rows, columns = _grid(vision, image.height, image.width)
    frames = []
    if rows:
        height, width = tiled_size(image.height, image.width, vision.tile)
        image = image.resize((width, height), vision.resample)
        tile = vision.tile
        for r in range(rows):
            for c in range(columns):
                frames.append(image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)))
    frames.append(image.resize(size, vision.resample))
    pixels = torch.stack([normalized(frame, vision.mean, vision.std) for frame in frames])
    return pixels, (rows, columns)


@torch.inference_mode()
def encode(vision: Idefics3Vision, images: Sequence) -> list[TiledImage]:
    """Each (Pillow) image's soft tokens, its tiles and the whole image encoded together
    (each tile's patches attend to each other only)."""
    out = []
    for image in images:
        pixels, (rows, columns) = pixel_values(vision, image)
        tokens = vision.encoder(pixels)
        tiles = tokens[:-1].reshape(rows, columns, *tokens.shape[1:])
        out.append(TiledImage(tiles, tokens[-1]))
    return out


def expansion(rows: int, columns: int, tokens: int) -> str:
    """The text in place of an image of rows x columns tiles (0, 0: the whole image
    alone) of `tokens` soft tokens each (SmolVLMProcessor's get_image_prompt_string)."""
    whole = f"{FAKE}{GLOBAL}{IMAGE * tokens}{FAKE}"
    if not rows:
        return whole
    text = "".join(
        "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE * tokens}" for c in range(columns)) + "\n"
        for r in range(rows)
    )
    return f"{text}\n{whole}"


def image_tokens(vision: Idefics3Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it: its
    expansion's, each newline counted as one token (at most one too many, where the
    vocabulary has "\\n\\n" as one)."""
    rows, columns = _grid(vision, *_resized(vision, image.height, image.width))
    whole = vision.tile_tokens + 3
    return whole if not rows else rows * columns * (vision.tile_tokens + 2) + rows + 1 + whole


def _image_id(tokenizer: Tokenizer) -> int:
    """The id of <image>, where the tokenizer has SmolVLM's image tokens."""
    missing = [t for t in (FAKE, IMAGE, GLOBAL) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not SmolVLM's")
    return tokenizer.token_id(IMAGE)


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[TiledImage],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> expanded for the image `encoded` (encode's)
    in order, and the images as generate() takes them: each one's span from its first
    <image> to its last, the soft tokens in the <image> places and the embeddings
    (`embed_token(id)`, [hidden]) of the text tokens between them. The text must mark
    exactly as many places as there are images."""
    expansions = [expansion(*e.grid, e.whole.shape[0]) for e in encoded]
    softs = [torch.cat([e.tiles.flatten(0, 2), e.whole]) for e in encoded]
    return spans_prompt(tokenizer, text, _image_id(tokenizer), expansions, softs, embed_token)


def spans_prompt(
    tokenizer: Tokenizer,
    text: str,
    image: int,
    expansions: Sequence[str],
    softs: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> (the token `image`) replaced by its image's
    `expansions` in order, and the images as generate() takes them: each one's span from
    its first <image> to its last, its soft tokens `softs` [<image>s, hidden] in the
    <image> places and the embeddings (`embed_token(id)`, [hidden]) of the text tokens
    between them. The text must mark exactly as many places as there are images."""
    places = text.count(IMAGE)
    if places != len(expansions):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(expansions)} image{'s' * (len(expansions) != 1)}: write {IMAGE} where "
            "each goes"
        )
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        written + piece for written, piece in zip(expansions, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    where = [i for i, t in enumerate(ids) if t == image]
    if len(where) != sum(soft.shape[0] for soft in softs):
        raise UsageError(f"the prompt holds {IMAGE} of its own: remove it")
    starts, embeds, done = [], [], 0
    for soft in softs:
        first, last = where[done], where[done + soft.shape[0] - 1]
        done += soft.shape[0]
        span = ids[first : last + 1]
        rows = torch.empty(len(span), soft.shape[1], dtype=soft.dtype)
        is_soft = torch.tensor([t == image for t in span])
        rows[is_soft] = soft
        for i in (~is_soft).nonzero().flatten().tolist():
            rows[i] = embed_token(span[i]).to(soft.dtype)
        starts.append(first)
        embeds.append(rows)
    return ids, PromptImages(embeds, starts)
