"""Prompts with images, for LFM2-VL: each image resized (and, where large, cut into
tiles plus a thumbnail) as transformers' Lfm2VlImageProcessor does, its frames encoded
(llmrun.models.lfm2_vl_vision), and each image place that the chat template marks
(<image>) expanded as Lfm2VlProcessor expands it: <|image_start|>, then per tile
<|img_row_R_col_C|> and its <image> tokens and <|img_thumbnail|> before the thumbnail's
(or the one frame's <image> tokens alone), then <|image_end|>. An image's span runs from
its first <image> to its last; the text tokens inside it take the language model's own
embeddings, as transformers embeds them.

Resizing is bilinear and antialiased on the uint8 pixels (torch's, which the processor's
torchvision backend calls). llama.cpp (mtmd-image.h's LFM2 slicing, clip.cpp) resizes with
its own bilinear filter and always takes 64 to 256 tokens an image, as an mmproj does here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun.errors import TokenizerError
from llmrun.idefics3_images import spans_prompt
from llmrun.loading.lfm2_vl_vision import Lfm2VlVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE, START, END, THUMBNAIL = "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"


@dataclass(frozen=True)
class Layout:
    """How an image is cut: a grid of rows x columns tiles of tile_size pixels (1 x 1:
    not cut) and the (height, width) of the single frame or the thumbnail."""

    rows: int
    columns: int
    height: int
    width: int

    @property
    def tiled(self) -> bool:
        return self.rows > 1 or self.columns > 1


@dataclass(frozen=True)
class EncodedImage:
    """An image's soft tokens [tokens, hidden], frame by frame (tiles row by row, then the
    thumbnail), and its layout."""

    tokens: torch.Tensor
    layout: Layout


def _round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


def smart_size(vision: Lfm2VlVision, height: int, width: int) -> tuple[int, int]:
    """The (height, width) of an image as one frame: multiples of patch x factor, within
    the image token limits, the aspect kept (Lfm2VlImageProcessor.smart_resize)."""
    unit = vision.patch * vision.factor
    most = vision.max_image_tokens * unit**2
    least = vision.min_image_tokens * unit**2
    new_height = max(unit, _round_by(height, unit))
    new_width = max(unit, _round_by(width, unit))
    if new_height * new_width > most:
        beta = math.sqrt(height * width / most)
        new_height = max(unit, math.floor(height / beta / unit) * unit)
        new_width = max(unit, math.floor(width / beta / unit) * unit)
    elif new_height * new_width < least:
        beta = math.sqrt(least / (height * width))
        new_height = math.ceil(height * beta / unit) * unit
        new_width = math.ceil(width * beta / unit) * unit
    return new_height, new_width


def _grid(vision: Lfm2VlVision, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) of tiles whose aspect is nearest the image's, ties to the larger
    grid where the image covers over half of it (find_closest_aspect_ratio)."""
    low, high = vision.min_tiles, vision.max_tiles
    ratios = sorted(
        {
            (w, h)
            for n in range(low, high + 1)
            for w in range(1, n + 1)
            for h in range(1, n + 1)
            if low <= w * h <= high
        },
        key=lambda r: r[0] * r[1],
    )
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for w, h in ratios:
        diff = abs(aspect - w / h)
        if diff < best_diff:
            best, best_diff = (w, h), diff
        elif diff == best_diff and height * width > 0.5 * vision.tile_size**2 * w * h:
            best = (w, h)
    return best[1], best[0]


def layout(vision: Lfm2VlVision, height: int, width: int) -> Layout:
    """How an image of height x width pixels is cut (Lfm2VlImageProcessor._get_split_layout)."""
    unit = vision.patch * vision.factor
    splits = vision.do_image_splitting and not vision.min_tiles == vision.max_tiles == 1
    rounded = max(vision.patch, _round_by(height, unit)) * max(vision.patch, _round_by(width, unit))
    large = rounded > vision.max_image_tokens * unit**2 * vision.max_pixels_tolerance
    new_height, new_width = smart_size(vision, height, width)
    rows, columns = _grid(vision, height, width) if splits and large else (1, 1)
    return Layout(rows, columns, new_height, new_width)


def _resized(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 pixels [1, 3, H, W] resized bilinearly, antialiased, as torchvision's resize."""
    return F.interpolate(pixels, size=(height, width), mode="bilinear", antialias=True)


def frames(vision: Lfm2VlVision, image) -> tuple[list[torch.Tensor], Layout]:
    """An RGB Pillow image's frames, each float32 normalized pixels [3, H, W] (tiles row by
    row, then the thumbnail; or the one resized frame), and its layout."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    cut = layout(vision, image.height, image.width)
    out = []
    if cut.tiled:
        tile = vision.tile_size
        grid = _resized(pixels, tile * cut.rows, tile * cut.columns)[0]
        for r in range(cut.rows):
            for c in range(cut.columns):
                out.append(grid[:, r * tile : (r + 1) * tile, c * tile : (c + 1) * tile])
        if vision.use_thumbnail:
            out.append(_resized(pixels, cut.height, cut.width)[0])
    else:
        out.append(_resized(pixels, cut.height, cut.width)[0])
    # As the processor's fused rescale and normalize: (x - 255 mean) / (255 std) in float32.
    mean = torch.tensor([m / (1 / 255) for m in vision.mean], dtype=torch.float32)[:, None, None]
    std = torch.tensor([s / (1 / 255) for s in vision.std], dtype=torch.float32)[:, None, None]
    return [(frame.float() - mean) / std for frame in out], cut


def patches(frame: torch.Tensor, patch: int) -> torch.Tensor:
    """Normalized pixels [3, H, W] -> [H/p * W/p, p * p * 3], patches row by row, each
    flattened (row, column, channel) as convert_image_to_patches does."""
    channels, height, width = frame.shape
    x = frame.reshape(channels, height // patch, patch, width // patch, patch)
    return x.permute(1, 3, 2, 4, 0).reshape((height // patch) * (width // patch), -1)


@torch.inference_mode()
def encode(vision: Lfm2VlVision, images: Sequence) -> list[EncodedImage]:
    """Each (Pillow) image's soft tokens, its same-sized frames encoded together."""
    out = []
    for image in images:
        pixels, cut = frames(vision, image)
        groups: list[list[torch.Tensor]] = []
        for frame in pixels:  # the tiles, then a thumbnail of another size
            if groups and groups[-1][0].shape == frame.shape:
                groups[-1].append(frame)
            else:
                groups.append([frame])
        tokens = []
        for group in groups:
            _, height, width = group[0].shape
            batch = torch.stack([patches(f, vision.patch) for f in group])
            encoded = vision.encoder(batch, height // vision.patch, width // vision.patch)
            tokens.append(encoded.flatten(0, 1))
        out.append(EncodedImage(torch.cat(tokens), cut))
    return out


def _frame_tokens(vision: Lfm2VlVision, height: int, width: int) -> int:
    unit = vision.patch * vision.factor
    return (height // unit) * (width // unit)


def expansion(vision: Lfm2VlVision, cut: Layout) -> str:
    """The text in place of an image of this layout (Lfm2VlProcessor._build_image_tokens)."""
    single = IMAGE * _frame_tokens(vision, cut.height, cut.width)
    if not cut.tiled:
        return f"{START}{single}{END}"
    tile = IMAGE * _frame_tokens(vision, vision.tile_size, vision.tile_size)
    text = "".join(
        f"<|img_row_{r + 1}_col_{c + 1}|>{tile}"
        for r in range(cut.rows)
        for c in range(cut.columns)
    )
    thumbnail = f"{THUMBNAIL}{single}" if vision.use_thumbnail else ""
    return f"{START}{text}{thumbnail}{END}"


def image_tokens(vision: Lfm2VlVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    cut = layout(vision, image.height, image.width)
    single = _frame_tokens(vision, cut.height, cut.width)
    if not cut.tiled:
        return single + 2
    tiles = cut.rows * cut.columns * (1 + _frame_tokens(vision, vision.tile_size, vision.tile_size))
    return tiles + (1 + single if vision.use_thumbnail else 0) + 2


def _image_id(tokenizer: Tokenizer) -> int:
    """The id of <image>, where the tokenizer has LFM2-VL's image tokens."""
    missing = [t for t in (IMAGE, START, END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not LFM2-VL's")
    return tokenizer.token_id(IMAGE)


def prompt(
    vision: Lfm2VlVision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[EncodedImage],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> expanded for the image `encoded` (encode's)
    in order, and the images as generate() takes them: each one's span from its first
    <image> to its last, the soft tokens in the <image> places and the embeddings
    (`embed_token(id)`, [hidden]) of the text tokens between them. The text must mark
    exactly as many places as there are images."""
    expansions = [expansion(vision, e.layout) for e in encoded]
    softs = [e.tokens for e in encoded]
    return spans_prompt(tokenizer, text, _image_id(tokenizer), expansions, softs, embed_token)
