"""Prompts with images, for Mistral 3 (Mistral Small 3.1/3.2): each image resized as
transformers' PixtralImageProcessor does, encoded (llmrun.models.pixtral), and each image
place that the chat template marks ([IMG]) expanded as PixtralProcessor expands it: a row
of [IMG] per row of merged patches, [IMG_BREAK] after each row, [IMG_END] in place of
the last one. An image's embeddings take the place of its [IMG] and [IMG_BREAK] tokens,
the latter's the language model's own embedding of [IMG_BREAK] (as transformers embeds
the token; llama.cpp splices in the mmproj's copy of that row): one span per image, as
llmrun.multimodal.PromptImages and the server's prefix cache take them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.pixtral_vision import PixtralVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE, IMAGE_BREAK, IMAGE_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


def resized_size(height: int, width: int, longest_edge: int, unit: int) -> tuple[int, int]:
    """The (height, width) PixtralImageProcessor resizes an image to: scaled down (never
    up) to fit longest_edge, keeping its aspect, each side then rounded up to a multiple
    of `unit` (get_resize_output_image_size)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // unit + 1) * unit, ((width - 1) // unit + 1) * unit


def pixel_values(
    image, longest_edge: int, unit: int, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """Float32 pixels [3, H, W] of an RGB Pillow image, as PixtralImageProcessor's Pillow
    backend makes them: resized bicubically to resized_size, / 255, (x - mean) / std."""
    from PIL import Image

    height, width = resized_size(image.height, image.width, longest_edge, unit)
    return normalized(image.resize((width, height), Image.Resampling.BICUBIC), mean, std)


@torch.inference_mode()
def encode(vision: PixtralVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows, columns, hidden], encoded one at a time: an
    image's patches attend to each other only."""
    unit = vision.encoder.args.unit
    return [
        vision.encoder(pixel_values(image, vision.longest_edge, unit, vision.mean, vision.std))
        for image in images
    ]


def _token_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    ids = [tokenizer.token_id(text) for text in (IMAGE, IMAGE_BREAK, IMAGE_END)]
    missing = [t for t, i in zip((IMAGE, IMAGE_BREAK, IMAGE_END), ids, strict=True) if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Mistral 3's")
    return ids[0], ids[1], ids[2]


def expansion(rows: int, columns: int) -> str:
    """The text in place of an image of rows x columns merged patches (PixtralProcessor's
    replace_image_token)."""
    return (IMAGE * columns + IMAGE_BREAK) * (rows - 1) + IMAGE * columns + IMAGE_END


def expansion_tokens(rows: int, columns: int) -> int:
    """How many tokens expansion(rows, columns) is: its [IMG]s, [IMG_BREAK]s and [IMG_END]."""
    return rows * (columns + 1)


def image_tokens(vision: PixtralVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes: its expansion at the size encode
    resizes it to, known before encoding it."""
    unit = vision.encoder.args.unit
    height, width = resized_size(image.height, image.width, vision.longest_edge, unit)
    return expansion_tokens(height // unit, width // unit)


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each [IMG] expanded for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them: each one's rows with
    [IMG_BREAK]'s embedding (`embed_token(id)`, [hidden]) between them, from its first
    [IMG] to its last. The text must mark exactly as many places as there are images."""
    image, image_break, image_end = _token_ids(tokenizer)
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    grids = [tuple(e.shape[:2]) for e in encoded]
    expanded = pieces[0] + "".join(
        expansion(*grid) + piece for grid, piece in zip(grids, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    starts = [
        i
        for i, t in enumerate(ids)
        if t == image and (i == 0 or ids[i - 1] not in (image, image_break))
    ]
    expected = sum(expansion_tokens(*grid) for grid in grids)
    held = sum(ids.count(t) for t in (image, image_break, image_end))
    if len(starts) != len(encoded) or held != expected:
        raise UsageError(f"the prompt holds {IMAGE}, {IMAGE_BREAK} or {IMAGE_END} of its own")
    row_break = embed_token(image_break)
    embeds = []
    for e in encoded:
        # [rows, columns, hidden] -> rows of columns + 1, less the last [IMG_BREAK]
        breaks = row_break.to(e.dtype).expand(e.shape[0], 1, -1)
        embeds.append(torch.cat([e, breaks], dim=1).flatten(0, 1)[:-1])
    return ids, PromptImages(embeds, starts)
