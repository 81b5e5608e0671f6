"""Prompts with images, for Janus-Pro: each image prepared as transformers'
JanusImageProcessor does (its Pillow backend: the longer side resized to the tower's, the
shorter kept in proportion but at least min_size, bicubic; centred on a square of the
mean's colour; / 255, (x - mean) / std), encoded (llmrun.models.janus_vision), and each
image place that the chat template marks (<image_placeholder>) expanded as JanusProcessor
expands it: <begin_of_image>, one <image_placeholder> per patch, <end_of_image>, after
JanusProcessor's default system prompt where the folder's processor asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.janus_vision import JanusVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE, IMAGE_START, IMAGE_END = "<image_placeholder>", "<begin_of_image>", "<end_of_image>"
# transformers.models.janus.processing_janus.DEFAULT_SYSTEM_PROMPT
SYSTEM_PROMPT = (
    "You are a helpful language and vision assistant. "
    "You are able to understand the visual content that the user provides, "
    "and assist the user with a variety of tasks using natural language.\n\n"
)


def pixel_values(image, vision: JanusVision) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, S the tower's image size."""
    square = squared(image, vision.image_size, vision.min_size, vision.resample, vision.background)
    return normalized(square, vision.mean, vision.std)


def squared(image, side: int, min_size: int, resample: int, background: tuple[int, ...]):
    """An RGB Pillow image resized as JanusImageProcessor resizes it (the longer side to
    `side`, the shorter in proportion but at least `min_size`) and centred on a square of
    the `background` colour where it is not square."""
    from PIL import Image

    scale = side / max(image.height, image.width)
    # Python's round, as JanusImageProcessor's (half to even).
    height = max(round(image.height * scale), min_size)
    width = max(round(image.width * scale), min_size)
    resized = image.resize((width, height), Image.Resampling(resample))
    if height == width:
        return resized
    square = max(height, width)
    canvas = Image.new("RGB", (square, square), background)
    canvas.paste(resized, ((square - width) // 2, (square - height) // 2))
    return canvas


def image_tokens(vision: JanusVision, image) -> int:
    """How many prompt tokens an image takes: its patches and the two around them."""
    return vision.encoder.args.tokens_per_image + 2


@torch.inference_mode()
def encode(vision: JanusVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [patches, hidden], encoded one at a time."""
    return [vision.encoder(pixel_values(image, vision)[None])[0] for image in images]


def prompt(
    vision: JanusVision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image_placeholder> expanded for the image `encoded`
    (encode's tokens) in order, and the images as generate() takes them. The text must
    mark exactly as many places as there are images."""
    missing = [t for t in (IMAGE, IMAGE_START, IMAGE_END) if tokenizer.token_id(t) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Janus-Pro's")
    places = text.count(IMAGE)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {IMAGE} where each goes"
        )
    pieces = text.split(IMAGE)
    expanded = pieces[0] + "".join(
        f"{IMAGE_START}{IMAGE * len(e)}{IMAGE_END}{piece}"
        for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    if vision.system_prompt:
        expanded = SYSTEM_PROMPT + expanded
    ids = tokenizer.encode(expanded)
    image = tokenizer.token_id(IMAGE)
    starts = [i for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] != image)]
    return ids, PromptImages(list(encoded), starts)
