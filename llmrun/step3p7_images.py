"""Prompts with images, for Step 3.7: each image cut as transformers' Step3p7ImageProcessor
cuts it (a global view resized to a square, and where the image is large or elongated,
local crops of a window chosen by its aspect, resized to squares), encoded
(llmrun.models.step3p7_vision), and each image place that the chat template marks
(<im_patch>) expanded as Step3p7Processor expands it: for each crop <patch_start>, its soft
tokens' <im_patch>es and <patch_end> (and <patch_newline> after each row of crops but the
last), then <im_start>, the global view's <im_patch>es and <im_end>. An image's span runs
from its first soft token through its last; the markers between keep their own
embeddings.

Resizing is on the uint8 pixels, bilinear and antialiased (torch's, which the processor's
torchvision backend calls); normalizing is its fused (x - 255 mean) / (255 std) in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.step3p7_vision import Step3p7Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

# Step3p7Processor's tokens: an image place (and each soft token), a crop's start, end and
# row end, the global view's start and end.
IMAGE, CROP_START, CROP_END, NEWLINE, GLOBAL_START, GLOBAL_END = (
    "<im_patch>",
    "<patch_start>",
    "<patch_end>",
    "<patch_newline>",
    "<im_start>",
    "<im_end>",
)
TOKENS = (IMAGE, CROP_START, CROP_END, NEWLINE, GLOBAL_START, GLOBAL_END)


@dataclass(frozen=True)
class Plan:
    """How an image is cut (Step3p7ImageProcessor._plan_patches): padded to a square first
    (`square`), resized to `scaled` (width, height) for the global view, and to `cropped`
    for `columns` x `rows` local crops of `window` pixels (none where window is 0)."""

    square: bool
    scaled: tuple[int, int]
    cropped: tuple[int, int]
    window: int
    columns: int
    rows: int

    @property
    def crops(self) -> int:
        return self.columns * self.rows


def plan(vision: Step3p7Vision, width: int, height: int) -> Plan:
    """The cut of a width x height image: near-degenerate ones (a side under 32 pixels,
    the aspect over 4) squared, large ones scaled to max_image_size; a window of the
    shorter side for a small elongated image (aspect over 1.5), of the shorter side up to
    the crop size for a very elongated large one (aspect over 4), else the crop size; each
    side snapped to a whole number of windows, up where the rest is over a fifth of one."""
    square = min(width, height) < 32 and max(width / height, height / width) > 4
    if square:
        width = height = max(width, height)
    if max(width, height) > vision.max_image_size:
        scale = vision.max_image_size / max(width, height)
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= vision.size:
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, vision.crop)
    else:
        window = vision.crop
    if window == 0:
        return Plan(square, (width, height), (width, height), 0, 0, 0)
    snapped = [
        window * (side // window + (side % window > 0.2 * window)) if side >= window else side
        for side in (width, height)
    ]
    columns, rows = (max(1, side // window) for side in snapped)
    return Plan(square, (width, height), (snapped[0], snapped[1]), window, columns, rows)


def _resized(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """uint8 pixels [1, 3, H, W] resized as torchvision's resize (none where the size is
    the same)."""
    if tuple(pixels.shape[2:]) == (height, width):
        return pixels
    return F.interpolate(pixels, size=(height, width), mode="bilinear", antialias=True)


def _normalized(vision: Step3p7Vision, pixels: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor([m / (1 / 255) for m in vision.mean], dtype=torch.float32)[:, None, None]
    std = torch.tensor([s / (1 / 255) for s in vision.std], dtype=torch.float32)[:, None, None]
    return (pixels.float() - mean) / std


def pixel_values(vision: Step3p7Vision, image) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB Pillow image's global view [3, size, size] and local crops [crops, 3, crop,
    crop] (row by row; none: [0, 3, crop, crop]), in float32."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(1, image.height, image.width, 3).permute(0, 3, 1, 2)
    cut = plan(vision, image.width, image.height)
    if cut.square:  # the image at the top left, zeros elsewhere
        side = max(image.width, image.height)
        pixels = F.pad(pixels, (0, side - image.width, 0, side - image.height))
    view = _resized(_resized(pixels, *cut.scaled), vision.size, vision.size)[0]
    crops = torch.zeros(0, 3, vision.crop, vision.crop)
    if cut.window:
        grid = _resized(pixels, *cut.cropped)
        w = cut.window
        pieces = [
            grid[:, :, top : top + w, left : left + w]
            for top in range(0, grid.shape[2], w)
            for left in range(0, grid.shape[3], w)
        ]
        crops = torch.stack(
            [_normalized(vision, _resized(p, vision.crop, vision.crop)[0]) for p in pieces]
        )
    return _normalized(vision, view), crops


def image_tokens(vision: Step3p7Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it."""
    cut = plan(vision, image.width, image.height)
    newlines = cut.rows - 1 if cut.crops else 0
    return cut.crops * (vision.crop_tokens + 2) + newlines + vision.global_tokens + 2


@dataclass
class Encoded:
    """An image's soft tokens: its crops' [crops, crop tokens, hidden] and its global
    view's [global tokens, hidden], and its crops' columns."""

    crops: torch.Tensor
    view: torch.Tensor
    columns: int


@torch.inference_mode()
def encode(vision: Step3p7Vision, images: Sequence) -> list[Encoded]:
    """Each (Pillow) image's soft tokens."""
    out = []
    for image in images:
        view, crops = pixel_values(vision, image)
        columns = plan(vision, image.width, image.height).columns
        width = vision.encoder.args.text_hidden_size
        features = vision.encoder(crops) if len(crops) else torch.zeros(0, 0, width)
        out.append(Encoded(features, vision.encoder(view[None])[0], columns))
    return out


def _expanded(vision: Step3p7Vision, encoded: Encoded) -> str:
    """Step3p7Processor.replace_image_token's text for one image."""
    crop = CROP_START + IMAGE * vision.crop_tokens + CROP_END
    crops = len(encoded.crops)
    text = "".join(
        crop + (NEWLINE if (i + 1) % encoded.columns == 0 and i + 1 < crops else "")
        for i in range(crops)
    )
    return text + GLOBAL_START + IMAGE * vision.global_tokens + GLOBAL_END


def prompt(
    vision: Step3p7Vision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[Encoded],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <im_patch> expanded for the image `encoded` in order, and
    the images as generate() takes them: each one's span from its first soft token to its
    last, the soft tokens in the <im_patch> places and `embed_token(id)` ([hidden]) in the
    markers' between. The text must mark exactly as many places as there are images."""
    ids_of = {t: tokenizer.token_id(t) for t in TOKENS}
    missing = [t for t, i in ids_of.items() if i is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Step 3.7's")
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    expanded = [_expanded(vision, e) for e in encoded]
    ids = tokenizer.encode(
        pieces[0] + "".join(e + piece for e, piece in zip(expanded, pieces[1:], strict=True))
    )
    image = ids_of[IMAGE]
    soft = [i for i, t in enumerate(ids) if t == image]
    lengths = [len(e.crops) * vision.crop_tokens + vision.global_tokens for e in encoded]
    if len(soft) != sum(lengths) or any(
        ids.count(ids_of[t]) != sum(x.count(t) for x in expanded) for t in TOKENS[1:]
    ):
        raise UsageError(
            f"the prompt holds image tokens of its own ({', '.join(TOKENS)}): remove them"
        )
    embeds, starts, taken = [], [], 0
    for e, length in zip(encoded, lengths, strict=True):
        first, last = soft[taken], soft[taken + length - 1]
        taken += length
        features = iter(torch.cat([e.crops.flatten(0, 1), e.view]))
        rows = [next(features) if t == image else embed_token(t) for t in ids[first : last + 1]]
        embeds.append(torch.stack([r.to(e.view.dtype) for r in rows]))
        starts.append(first)
    return ids, PromptImages(embeds, starts)
