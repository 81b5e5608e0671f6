"""Prompts with an image, for Kosmos-2: the image prepared as CLIPImageProcessor does (its
Pillow backend), encoded (llmrun.models.kosmos2_vision) to its latent queries' tokens, and
the prompt laid out as Kosmos2Processor lays it out: <s>, <image>, the image's
placeholders (the ids after <unk>'s, one a query), </image>, then the stripped text
(<grounding> before it asks for grounded phrases: <phrase>...</phrase><object><patch_index_XXXX>
...</object>, which the reply writes as text). One image a prompt, before the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.llava_images import _resized
from llmrun.loading.kosmos2_vision import Kosmos2Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

BOI, EOI, UNK = "<image>", "</image>", "<unk>"


def pixel_values(vision: Kosmos2Vision, image: Any) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, as the processor makes them."""
    return normalized(_resized(vision, image), vision.mean, vision.std)


def image_tokens(vision: Kosmos2Vision, image: Any) -> int:
    """How many prompt tokens an image takes: its queries' and <image>, </image>."""
    return vision.queries + 2


@torch.inference_mode()
def encode(vision: Kosmos2Vision, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [queries, text hidden]."""
    return [vision.encoder(pixel_values(vision, image)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of <s>, the image `encoded` between <image> and </image>, and `text`, and
    the image as generate() takes it."""
    if len(encoded) != 1:
        raise UsageError(f"Kosmos-2 takes one image a prompt, not {len(encoded)}")
    boi, eoi, unk, bos = (tokenizer.token_id(t) for t in (BOI, EOI, UNK, "<s>"))
    if None in (boi, eoi, unk, bos):
        raise TokenizerError(f"the tokenizer has no <s>, {UNK}, {BOI} or {EOI}: not Kosmos-2's")
    queries = len(encoded[0])
    # As Kosmos2Processor writes it: <image> repeated as the placeholders, space-separated.
    laid_out = " ".join([BOI] * (queries + 1) + [EOI])
    ids = tokenizer.encode(f"<s>{laid_out} {text.strip()}", add_bos=False)
    if ids[: queries + 3] != [bos, *[boi] * (queries + 1), eoi] or ids.count(boi) != queries + 1:
        raise UsageError(f"the prompt holds {BOI} or {EOI} of its own: remove it")
    ids[2 : 2 + queries] = range(unk + 1, unk + 1 + queries)
    return ids, PromptImages(list(encoded), [2])
