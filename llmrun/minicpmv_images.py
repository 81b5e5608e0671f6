"""Prompts with images, for MiniCPM-V 4.6: each image resized and sliced as transformers'
MiniCPMV4_6ImageProcessorPil does it (the torchvision backend, transformers' default where
torchvision is installed, slices alike but resamples with its own filter), the whole image
and its slices encoded (llmrun.models.minicpmv_vision), and each image place that the chat
template marks (<|image_pad|>) expanded as MiniCPMV4_6Processor expands it:
<image_id>N</image_id> (N the image's number in the prompt, from 0; not where the image
processor's use_image_id is false), <image>, the whole image's <|image_pad|> tokens,
</image>, then per slice <slice>, its tokens, </slice>, a newline between rows of slices.
An image's span runs from its first <|image_pad|> to its last; the text tokens inside it
take the language model's own embeddings, as transformers embeds them. The language model
turns image tokens by their places, as text (MiniCPMV4_6Model passes no positions).

The whole image is resized to about scale_resolution² pixels (up or down where it is not
sliced, only down where it is), its sides multiples of a soft token's square of pixels;
an image of more than scale_resolution² pixels is also cut into a grid of slices near its
aspect ratio (of multiple - 1, multiple or multiple + 1 slices, multiple the pixel ratio
rounded up, at most max_slices), each about scale_resolution² pixels.

llama.cpp (tools/mtmd: mtmd_image_preprocessor_minicpmv, MTMD_SLICE_TMPL_MINICPMV_2_6)
slices alike but differs: it writes no <image_id>N</image_id>, rounds a side's multiple of
a half away from zero (transformers' Python round takes the even one: a 40x64 image's whole
view is 32x32 pixels there, 32x48 in llama.cpp), resamples with its own filter, and turns
the image tokens of its qwen35 text by M-RoPE (the time and height sections at the image's
first place, the width's along its tokens), where transformers turns them as text.

MiniCPM-V 4.7 (MiniCPMV4_7Processor: 4.6's processing and expansion) turns its tokens by
canvas M-RoPE (llmrun.minicpmv_canvas): an image's span then runs from its <image> to the
markers that close it, whose positions are pinned to its canvas too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmrun import minicpmv_canvas
from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.minicpmv_vision import MiniCPMV47Vision, MiniCPMVVision
from llmrun.multimodal import PromptImages
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

IMAGE_PAD, IMAGE_START, IMAGE_END = "<|image_pad|>", "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
ID_START, ID_END = "<image_id>", "</image_id>"


@dataclass(frozen=True)
class SlicedImage:
    """An image's soft tokens: the whole image's [tokens, hidden] and its slices'
    [rows, columns, tokens, hidden] (rows and columns 0 where it was not sliced), and the
    rows and columns of tokens of the whole image and of a slice ((0, 0): none)."""

    whole: torch.Tensor
    slices: torch.Tensor
    whole_grid: tuple[int, int]
    slice_grid: tuple[int, int]

    @property
    def grid(self) -> tuple[int, int]:
        return self.slices.shape[0], self.slices.shape[1]

    @property
    def soft(self) -> torch.Tensor:
        """All its soft tokens in prompt order: the whole image's, then the slices' row
        by row."""
        return torch.cat([self.whole, self.slices.flatten(0, 2)])


def _multiple(length: float, unit: int) -> int:
    """`length` rounded to a multiple of `unit` (ensure_divide), at least one."""
    return max(round(length / unit) * unit, unit)


def best_size(height: float, width: float, scale: int, unit: int, upscale: bool) -> tuple[int, int]:
    """The (height, width) an image (or a slice of height x width) is resized to
    (find_best_resize): scaled to about scale² pixels where larger or `upscale`, keeping
    its aspect, then each side rounded to a multiple of `unit`."""
    if height * width > scale * scale or upscale:
        aspect = width / height
        height = int(scale / math.sqrt(aspect))
        width = int(height * aspect)
    return _multiple(height, unit), _multiple(width, unit)


def slice_grid(height: int, width: int, scale: int, most: int) -> tuple[int, int]:
    """The rows and columns of slices of an image (get_sliced_grid); (0, 0): not sliced.
    Of the grids of multiple - 1 .. multiple + 1 slices (not 1, at most `most`), the one
    whose log aspect is nearest the image's, more rows on a tie."""
    log_ratio = math.log(width / height)
    multiple = min(math.ceil(width * height / (scale * scale)), most)
    if multiple <= 1:
        return 0, 0
    best, error = (1, 1), math.inf
    for count in (multiple - 1, multiple, multiple + 1):
        if count == 1 or count > most:
            continue
        for rows in range(1, count + 1):
            if count % rows:
                continue
            off = abs(log_ratio - math.log(count // rows / rows))
            if off < error or (off == error and rows > best[0]):
                best, error = (rows, count // rows), off
    return best


def _grid(vision: MiniCPMVVision, image) -> tuple[int, int]:
    if not vision.slicing:
        return 0, 0
    return slice_grid(image.height, image.width, vision.scale_resolution, vision.max_slices)


def _whole_size(vision: MiniCPMVVision, image, grid: tuple[int, int]) -> tuple[int, int]:
    scale, unit = vision.scale_resolution, vision.unit
    return best_size(image.height, image.width, scale, unit, upscale=grid[0] == 0)


def _refined_size(vision: MiniCPMVVision, image, grid: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) the image is resized to before it is cut into the grid's
    slices (get_refine_size): each slice best_size's, upscaled too."""
    rows, columns = grid
    height, width = _multiple(image.height, rows), _multiple(image.width, columns)
    scale, unit = vision.scale_resolution, vision.unit
    tile_h, tile_w = best_size(height / rows, width / columns, scale, unit, upscale=True)
    return tile_h * rows, tile_w * columns


def pixel_values(vision: MiniCPMVVision, image) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float32 pixels of an RGB Pillow image as MiniCPMV4_6ImageProcessorPil makes them:
    the whole image [3, H, W], and its slices [3, h, w] row by row (none where it is not
    sliced)."""
    grid = _grid(vision, image)
    height, width = _whole_size(vision, image, grid)
    whole = normalized(image.resize((width, height), vision.resample), vision.mean, vision.std)
    if not grid[0]:
        return whole, []
    height, width = _refined_size(vision, image, grid)
    refined = image.resize((width, height), vision.resample)
    tile_h, tile_w = height // grid[0], width // grid[1]
    slices = [
        normalized(
            refined.crop((c * tile_w, r * tile_h, (c + 1) * tile_w, (r + 1) * tile_h)),
            vision.mean,
            vision.std,
        )
        for r in range(grid[0])
        for c in range(grid[1])
    ]
    return whole, slices


@torch.inference_mode()
def encode(vision: MiniCPMVVision, images: Sequence) -> list[SlicedImage]:
    """Each (Pillow) image's soft tokens, the whole image's and its slices' (of one
    size: encoded together, each slice's patches attending within it)."""
    out = []
    for image in images:
        whole, slices = pixel_values(vision, image)
        rows, columns = _grid(vision, image)
        tokens = vision.encoder(whole[None])[0]
        if slices:
            sliced = vision.encoder(torch.stack(slices))
            sliced = sliced.view(rows, columns, *sliced.shape[1:])
        else:
            sliced = tokens.new_zeros(0, 0, *tokens.shape)
        grids = [(t.shape[1] // vision.unit, t.shape[2] // vision.unit) for t in [whole, *slices]]
        out.append(SlicedImage(tokens, sliced, grids[0], grids[1] if slices else (0, 0)))
    return out


def expansion(number: int | None, whole: int, rows: int, columns: int, per_slice: int) -> str:
    """The text in place of an image (replace_image_token, led by _prepend_local_ids' number
    unless None) whose whole image takes `whole` soft tokens and each of its rows x columns
    slices `per_slice`."""
    text = "" if number is None else f"{ID_START}{number}{ID_END}"
    text += f"{IMAGE_START}{IMAGE_PAD * whole}{IMAGE_END}"
    row = f"{SLICE_START}{IMAGE_PAD * per_slice}{SLICE_END}" * columns
    return text + "\n".join([row] * rows)


def image_tokens(vision: MiniCPMVVision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it: its
    expansion's, its number counted as one token (an image of number 10 on may take
    more) and each newline as one."""
    grid = _grid(vision, image)
    height, width = _whole_size(vision, image, grid)
    count = height * width // vision.unit**2 + 2 + (3 if vision.image_ids else 0)
    if grid[0]:
        height, width = _refined_size(vision, image, grid)
        per_slice = height * width // vision.unit**2 // (grid[0] * grid[1])
        count += grid[0] * grid[1] * (per_slice + 2) + grid[0] - 1
    return count


def _pad_id(vision: MiniCPMVVision, tokenizer: Tokenizer) -> int:
    """The id of <|image_pad|>, where the tokenizer has MiniCPM-V's image tokens."""
    needed = [IMAGE_PAD, IMAGE_START, IMAGE_END, SLICE_START, SLICE_END]
    needed += [ID_START, ID_END] if vision.image_ids else []
    missing = [t for t in needed if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not MiniCPM-V's")
    return tokenizer.token_id(IMAGE_PAD)


def prompt(
    vision: MiniCPMVVision,
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[SlicedImage],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> expanded for the image `encoded`
    (encode's) in order, and the images as generate() takes them: each one's span from
    its first <|image_pad|> to its last (MiniCPM-V 4.7's: its canvas frame), the soft
    tokens in the <|image_pad|> places and the embeddings (`embed_token(id)`, [hidden]) of
    the text tokens between them. The text must mark exactly as many places as there are
    images."""
    pad = _pad_id(vision, tokenizer)
    places = text.count(IMAGE_PAD)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE_PAD}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE_PAD} where each goes"
        )
    pieces = text.split(IMAGE_PAD)
    expanded = pieces[0]
    for number, (e, piece) in enumerate(zip(encoded, pieces[1:], strict=True)):
        per_slice = e.slices.shape[2] if e.grid[0] else 0
        shown = number if vision.image_ids else None
        expanded += expansion(shown, e.whole.shape[0], *e.grid, per_slice) + piece
    ids = tokenizer.encode(expanded)
    where = [i for i, t in enumerate(ids) if t == pad]
    counts = [e.soft.shape[0] for e in encoded]
    if len(where) != sum(counts):
        raise UsageError(f"the prompt holds {IMAGE_PAD} of its own: remove it")
    rope = None
    if isinstance(vision, MiniCPMV47Vision):
        grids = []
        for e in encoded:
            grids += [e.whole_grid] + [e.slice_grid] * (e.grid[0] * e.grid[1])
        is_pad = [t == pad for t in ids]
        rope, spans = minicpmv_canvas.positions(ids, is_pad, grids, vision.markers)
    else:
        spans, done = [], 0
        for count in counts:
            spans.append((where[done], where[done + count - 1] + 1))
            done += count
    embeds = []
    for e, (first, end) in zip(encoded, spans, strict=True):
        span = ids[first:end]
        soft = e.soft
        rows = torch.empty(len(span), soft.shape[1], dtype=soft.dtype)
        is_soft = torch.tensor([t == pad for t in span])
        rows[is_soft] = soft
        for i in (~is_soft).nonzero().flatten().tolist():
            rows[i] = embed_token(span[i]).to(soft.dtype)
        embeds.append(rows)
    starts = [first for first, _ in spans]
    if rope is not None:
        return ids, QwenPromptImages(embeds, starts, rope)
    return ids, PromptImages(embeds, starts)
