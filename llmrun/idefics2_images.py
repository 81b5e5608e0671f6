"""Prompts with images, for Idefics2: each image prepared as transformers'
Idefics2ImageProcessor does (its Pillow backend), encoded (llmrun.models.idefics2_vision),
and each image place that the chat template marks (<image>) expanded as Idefics2Processor
expands it: <fake_token_around_image>, the perceiver's <image> tokens,
<fake_token_around_image> for each of the image's pictures (four crops and the whole image
where it splits images; the whole image else), two fake tokens side by side made one, and
a space after a closing fake token that a word follows. An image's span runs from its first
<image> to its last; the fake tokens inside it take the language model's own embeddings,
as transformers embeds them.

Idefics2ImageProcessor cuts an image into its four quarters before resizing them and the
whole; each picture's longer side is brought down to longest_edge, then either side up to
shortest_edge (the aspect not kept there). A batch's pictures are padded to the largest,
the padding masked out of the tower's attention and the resampler's: each picture alone is
the same, which is how llmrun encodes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.idefics2_vision import Idefics2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

FAKE, IMAGE = "<fake_token_around_image>", "<image>"
# Idefics2Processor's: a space after a fake token that neither whitespace nor a tag follows.
_CLOSING_FAKE = re.compile(rf"{re.escape(FAKE)}(?=[^\s<])")


def resized_size(height: int, width: int, shortest_edge: int, longest_edge: int) -> tuple[int, int]:
    """The (height, width) Idefics2ImageProcessor resizes a picture to
    (get_resize_output_image_size)."""
    aspect = width / height
    if width >= height and width > longest_edge:
        width, height = longest_edge, int(longest_edge / aspect)
    elif height > width and height > longest_edge:
        height, width = longest_edge, int(longest_edge * aspect)
    return max(height, shortest_edge), max(width, shortest_edge)


def pictures(vision: Idefics2Vision, image) -> list:
    """The Pillow pictures of an RGB image the tower sees, before normalization: its four
    quarters (top left, top right, bottom left, bottom right) and then the whole image
    where it splits images, else the whole image; each resized."""
    frames = [image]
    if vision.splitting:
        mid_w, mid_h = image.width // 2, image.height // 2
        boxes = [
            (0, 0, mid_w, mid_h),
            (mid_w, 0, image.width, mid_h),
            (0, mid_h, mid_w, image.height),
            (mid_w, mid_h, image.width, image.height),
        ]
        frames = [image.crop(box) for box in boxes] + frames
    if vision.longest_edge is None:
        return frames
    out = []
    for frame in frames:
        height, width = resized_size(
            frame.height, frame.width, vision.shortest_edge, vision.longest_edge
        )
        out.append(frame.resize((width, height), vision.resample))
    return out


def pixel_values(vision: Idefics2Vision, image) -> list[torch.Tensor]:
    """Float32 pixels [3, H, W] of each of an RGB Pillow image's pictures, unpadded."""
    patch = vision.encoder.args.vision.patch_size
    frames = pictures(vision, image)
    if any(min(frame.size) < patch for frame in frames):
        raise UsageError(
            f"a {image.width}x{image.height} image is smaller than one {patch}-pixel patch "
            "once prepared for Idefics2's tower"
        )
    return [normalized(frame, vision.mean, vision.std) for frame in frames]


@torch.inference_mode()
def encode(vision: Idefics2Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [pictures, latents, hidden], each picture encoded
    alone at its own size."""
    return [
        torch.cat([vision.encoder(pixels[None]) for pixels in pixel_values(vision, image)])
        for image in images
    ]


def image_tokens(vision: Idefics2Vision, image) -> int:
    """How many prompt tokens a (Pillow) image takes, known before encoding it: its
    pictures' <image> tokens and the fake tokens around them."""
    return vision.frames * (vision.tokens_per_frame + 1) + 1


def expanded_text(text: str, encoded: Sequence[torch.Tensor]) -> str:
    """`text` with each <image> replaced as Idefics2Processor replaces it, for the image
    `encoded` in order."""
    pieces = text.split(IMAGE)
    out = pieces[0]
    for frames, piece in zip(encoded, pieces[1:], strict=True):
        out += f"{FAKE}{IMAGE * frames.shape[1]}{FAKE}" * frames.shape[0] + piece
    out = out.replace(FAKE + FAKE, FAKE)
    return _CLOSING_FAKE.sub(FAKE + " ", out)


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image> expanded for the image `encoded` (encode's) in
    order, and the images as generate() takes them: each one's span from its first <image>
    to its last, the soft tokens in the <image> places and the embeddings
    (`embed_token(id)`, [hidden]) of the fake tokens between its pictures. The text must
    mark exactly as many places as there are images."""
    missing = [t for t in (FAKE, IMAGE) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Idefics2's")
    image = tokenizer.token_id(IMAGE)
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    ids = tokenizer.encode(expanded_text(text, encoded))
    where = [i for i, t in enumerate(ids) if t == image]
    counts = [frames.shape[0] * frames.shape[1] for frames in encoded]
    if len(where) != sum(counts):
        raise UsageError(f"the prompt holds {IMAGE} of its own: remove it")
    starts, embeds, done = [], [], 0
    for frames, count in zip(encoded, counts, strict=True):
        first, last = where[done], where[done + count - 1]
        done += count
        span = ids[first : last + 1]
        rows = torch.empty(len(span), frames.shape[2], dtype=frames.dtype)
        is_soft = torch.tensor([t == image for t in span])
        rows[is_soft] = frames.flatten(0, 1)
        for i in (~is_soft).nonzero().flatten().tolist():
            rows[i] = embed_token(span[i]).to(frames.dtype)
        starts.append(first)
        embeds.append(rows)
    return ids, PromptImages(embeds, starts)
