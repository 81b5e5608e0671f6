"""Prompts with an image, for GIT: the image prepared as CLIPImageProcessor does (its Pillow
backend: the shorter side resized, bicubic, centre-cropped; / 255, (x - mean) / std),
encoded (llmrun.models.git_vision), and its tokens put before the whole prompt, as
GitModel concatenates them; the text after them is [CLS] and the text's WordPiece ids
without [SEP], as GIT's model card builds input_ids ([CLS] alone: a caption; a question:
its answer). One image a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.llava_images import _resized
from llmrun.loading.git_vision import GitVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

CLS = "[CLS]"
PLACEHOLDER = 0  # never embedded: the image's tokens take its places


def pixel_values(vision: GitVision, image: Any) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, as the processor makes them."""
    return normalized(_resized(vision, image), vision.mean, vision.std)


def image_tokens(vision: GitVision, image: Any) -> int:
    """How many prompt tokens an image takes: its patches' and its class token's."""
    return vision.tokens_per_image


@torch.inference_mode()
def encode(vision: GitVision, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [patches + 1, text hidden]."""
    return [vision.encoder(pixel_values(vision, image)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of the image `encoded` (its placeholders), [CLS] and `text`, and the image
    as generate() takes it."""
    if len(encoded) != 1:
        raise UsageError(f"GIT takes one image a prompt, not {len(encoded)}")
    cls = tokenizer.token_id(CLS)
    if cls is None:
        raise TokenizerError(f"the tokenizer has no {CLS}: not GIT's (BERT's)")
    ids = [cls, *tokenizer.encode(text, add_bos=False)]
    return [PLACEHOLDER] * len(encoded[0]) + ids, PromptImages(list(encoded), [0])
