"""Prompts with an image, for Fuyu, as FuyuProcessor and its Pillow image processor make
them: an image larger than the processor's box shrunk into it (aspect kept, int sizes),
padded right and below to whole patches with the padding value (a byte value: the padding
is added before / 255), then (x - mean) / std; cut into patch_size squares, row by row,
each flattened pixel by pixel ([patch_h, patch_w, channel]) and embedded by the Linear
(llmrun.loading.fuyu_vision). The image goes before the whole prompt, whatever the text
says (one a prompt): each row of patches |SPEAKER| ids closed by a |NEWLINE| (whose own
embedding it keeps), then <s>, the text and <0x04> (Fuyu's beginning of answer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.fuyu_vision import FuyuVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE, NEWLINE, BOS = "|SPEAKER|", "|NEWLINE|", "<s>"
BEGINNING_OF_ANSWER = "<0x04>"


def _grid(vision: FuyuVision, image) -> tuple[tuple[int, int], tuple[int, int]]:
    """An image's size once shrunk into the processor's box, and its rows and columns of
    patches."""
    width, height = image.size
    if width > vision.max_width or height > vision.max_height:
        scale = min(vision.max_height / height, vision.max_width / width)
        width, height = int(width * scale), int(height * scale)
        if width < 1 or height < 1:
            raise UsageError(f"an image of {image.size[0]}x{image.size[1]} pixels is too narrow")
    patch = vision.patch_size
    rows = min(vision.max_height, math.ceil(height / patch) * patch) // patch
    columns = min(vision.max_width, math.ceil(width / patch) * patch) // patch
    return (width, height), (rows, columns)


def image_tokens(vision: FuyuVision, image) -> int:
    """How many prompt tokens an image takes: its patches and a |NEWLINE| a row."""
    _, (rows, columns) = _grid(vision, image)
    return rows * (columns + 1)


def patches(vision: FuyuVision, image) -> torch.Tensor:
    """An RGB Pillow image's patches [rows * columns, patch_size² * 3], float32."""
    from PIL import Image

    size, (rows, columns) = _grid(vision, image)
    if size != image.size:
        image = image.resize(size, Image.Resampling(vision.resample))
    patch = vision.patch_size
    fill = (vision.padding_value,) * 3
    padded = Image.new("RGB", (columns * patch, rows * patch), fill)
    padded.paste(image, (0, 0))
    pixels = normalized(padded, vision.mean, vision.std)
    # [3, rows * patch, columns * patch] -> [rows, columns, patch, patch, 3]
    cut = pixels.reshape(3, rows, patch, columns, patch).permute(1, 3, 2, 4, 0)
    return cut.reshape(rows * columns, patch * patch * 3)


@torch.inference_mode()
def encode(vision: FuyuVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's embedded patches [rows, columns, hidden]."""
    out = []
    for image in images:
        _, (rows, columns) = _grid(vision, image)
        out.append(vision.encoder(patches(vision, image)).reshape(rows, columns, -1))
    return out


def _token_ids(vision: FuyuVision, tokenizer: Tokenizer) -> tuple[int, int, int]:
    ids = [tokenizer.token_id(text) for text in (IMAGE, NEWLINE, BOS)]
    missing = [text for text, i in zip((IMAGE, NEWLINE, BOS), ids, strict=True) if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Fuyu's")
    if ids[0] != vision.image_token_id:
        raise TokenizerError(
            f"the tokenizer's {IMAGE} is id {ids[0]}, but the model's image_token_id is "
            f"{vision.image_token_id}"
        )
    return ids[0], ids[1], ids[2]


def prompt(
    vision: FuyuVision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of the image `encoded` (encode's patches), <s>, `text` and <0x04>, and the
    image as generate() takes it: its rows of patches, each followed by |NEWLINE|'s
    embedding (`embed_token(id)`, [hidden])."""
    if len(encoded) != 1:
        raise UsageError(f"Fuyu takes one image a prompt, not {len(encoded)}")
    image, newline, bos = _token_ids(vision, tokenizer)
    text_ids = tokenizer.encode(text + BEGINNING_OF_ANSWER, add_bos=False)
    if image in text_ids or newline in text_ids:
        raise UsageError(f"the prompt holds Fuyu's {IMAGE} or {NEWLINE} of its own: remove it")
    rows, columns, _ = encoded[0].shape
    ids = ([image] * columns + [newline]) * rows + [bos] + text_ids
    breaks = embed_token(newline).to(encoded[0].dtype).expand(rows, 1, -1)
    embeds = torch.cat([encoded[0], breaks], dim=1).flatten(0, 1)
    return ids, PromptImages([embeds], [0])
