"""Prompts with an image, for Llama 3.2 Vision (mllama): the image cut into tiles as
transformers' MllamaImageProcessor does (the canvas of at most max_image_tiles square tiles
that needs the least enlarging, else the least shrinking, the smallest of equals; the image
resized bilinearly onto it without distortion, never below one tile a side, padded with black
at the right and bottom before it is normalized; the tiles row by row, then zero tiles up to
max_image_tiles), its aspect ratio id (1-based, in get_all_supported_aspect_ratios' order),
encoded (llmrun.models.mllama_vision), and the prompt's one <|image|> placed as
MllamaProcessor's cross-attention mask places it: the text from <|image|> on attends to the
image's real tiles, the text before it to every tile (llmrun.models.mllama).

The image enters the language model by cross-attention, not as tokens: the prompt keeps its
one <|image|> token, and the prefill feeds everything up to it in one forward, which keeps
the image's keys and values in the cache for every later one (MllamaImages). One image a
conversation, as Meta recommends for the model and ollama allows (transformers' processor
takes several).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import UsageError
from llmrun.images import normalized
from llmrun.loading.mllama_vision import MllamaVision
from llmrun.models.mllama import CrossImage
from llmrun.models.mllama_vision import supported_ratios
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image|>"


@dataclass(frozen=True)
class EncodedImage:
    """An image's cross-attention states [max tiles * patches, hidden] and how many of its
    tiles are real (the first `tiles`)."""

    states: torch.Tensor
    tiles: int
    patches: int


def canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """The grid (rows, columns) an image of height x width is resized onto
    (get_optimal_tiled_canvas): of the grids it fits by enlarging, the least enlarging; else
    the least shrinking; of those, the smallest area (the first listed of equals)."""
    grids = supported_ratios(max_tiles)
    scales = [min(r * tile / height, c * tile / width) for r, c in grids]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    candidates = [g for g, s in zip(grids, scales, strict=True) if s == chosen]
    rows, columns = min(candidates, key=lambda g: g[0] * g[1])
    return rows, columns


def fit(height: int, width: int, rows: int, columns: int, tile: int) -> tuple[int, int]:
    """The (height, width) an image is resized to on a canvas of rows x columns tiles
    (get_image_size_fit_to_canvas): its aspect kept, each side between a tile and the
    canvas's."""
    target_w = min(max(width, tile), columns * tile)
    target_h = min(max(height, tile), rows * tile)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


def pixel_values(vision: MllamaVision, image) -> tuple[torch.Tensor, int, int]:
    """An RGB Pillow image's tiles [max tiles, 3, tile, tile] (zeros past its own), its
    aspect ratio id and its count of tiles."""
    from PIL import Image

    tile = vision.tile
    rows, columns = canvas(image.height, image.width, vision.max_tiles, tile)
    height, width = fit(image.height, image.width, rows, columns, tile)
    placed = Image.new("RGB", (columns * tile, rows * tile))
    placed.paste(image.resize((width, height), Image.Resampling.BILINEAR), (0, 0))
    pixels = normalized(placed, vision.mean, vision.std)
    # [3, rows * t, columns * t] -> [rows * columns, 3, t, t], row by row
    tiles = (
        pixels.view(3, rows, tile, columns, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
    )
    padded = torch.zeros(vision.max_tiles, 3, tile, tile)
    padded[: len(tiles)] = tiles
    ratio = supported_ratios(vision.max_tiles).index([rows, columns]) + 1
    return padded, ratio, len(tiles)


@torch.inference_mode()
def encode(vision: MllamaVision, images: Sequence) -> list[EncodedImage]:
    """Each (Pillow) image's cross-attention states, one image at a time."""
    out = []
    for image in images:
        pixels, ratio, tiles = pixel_values(vision, image)
        states = vision.encoder(pixels, ratio, tiles)
        out.append(EncodedImage(states, tiles, vision.encoder.args.vision.patches))
    return out


def image_tokens(vision: MllamaVision, image) -> int:
    """The prompt tokens an image takes: its <|image|> alone."""
    return 1


@dataclass
class MllamaImages(PromptImages):
    """A prompt's image as generate() takes it: embeds holds the one EncodedImage, starts
    the index of its <|image|>. Its span is the prompt up to <|image|>, fed in one forward
    (the text before the image attends to it too); no cached prefix is reused (the first
    image place is 0), so the cache's image is always this prompt's."""

    prefix_cached = False  # the cache's blocks hold no image: its first forward computes it

    @property
    def first(self) -> int:
        return 0

    def spans(self) -> list[tuple[int, int]]:
        return [(0, start + 1) for start in self.starts]

    def tokens(self, begin: int, end: int, device: torch.device) -> CrossImage | None:
        for (a, b), start, image in zip(self.spans(), self.starts, self.embeds, strict=True):
            if a < begin < b or a < end < b:
                raise ValueError(f"a forward of tokens {begin}..{end} splits the image's span")
            if begin <= a < b <= end:
                return CrossImage(image.states.to(device), start, image.tiles, image.patches)
        return None


def prompt(
    vision: MllamaVision, tokenizer: Tokenizer, text: str, encoded: Sequence[EncodedImage]
) -> tuple[list[int], MllamaImages]:
    """The ids of `text`, whose one <|image|> takes the one image `encoded`, and the image
    as generate() takes it."""
    if len(encoded) != 1:
        raise UsageError(f"Llama 3.2 Vision takes one image a conversation, not {len(encoded)}")
    places = text.count(IMAGE)
    if places != 1:
        raise UsageError(
            f"the prompt marks {places} image places ({IMAGE}) for 1 image: write {IMAGE} "
            "where it goes"
        )
    ids = tokenizer.encode(text)
    if ids.count(vision.image_token) != 1:
        raise UsageError(f"the tokenizer does not read {IMAGE} as the image's token")
    return ids, MllamaImages(list(encoded), [ids.index(vision.image_token)])
