"""Prompts with an image, for PaliGemma 1 and 2: the image prepared as transformers'
SiglipImageProcessor does (its Pillow backend: resized to the tower's square, bicubic by
default; / 255, (x - mean) / std), encoded (llmrun.models.paligemma_vision), and the prompt
laid out as PaliGemmaProcessor lays it out: the image's tokens, BOS, the text and "\\n"
(a text that writes <image> keeps what it writes before it). The whole prompt is one
group of embeddings from its first token, the image's then the text's, which the language
model sees both ways (llmrun.models.gemma's, llmrun.models.paligemma's); the answer
follows causally.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.paligemma_vision import PaliGemmaVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<image>"


@dataclass
class PrefixImages(PromptImages):
    """A PaliGemma prompt: one group (embeds[0], from index 0) covering all of it. Its
    cached keys and values depend on every token of the prompt, which salts its blocks."""

    ids: tuple[int, ...] = ()

    def salt(self) -> bytes:
        return hashlib.sha256(str(self.ids).encode()).digest()


def pixel_values(image, vision: PaliGemmaVision) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, S the tower's image size."""
    from PIL import Image

    side = vision.image_size
    resized = image.resize((side, side), Image.Resampling(vision.resample))
    return normalized(resized, vision.mean, vision.std)


def image_tokens(vision: PaliGemmaVision, image) -> int:
    """How many prompt tokens an image takes: one a patch."""
    return vision.tokens_per_image


@torch.inference_mode()
def encode(vision: PaliGemmaVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [patches, hidden], encoded one at a time."""
    return [vision.encoder(pixel_values(image, vision)[None])[0] for image in images]


def prompt(
    tokenizer: Tokenizer,
    text: str,
    encoded: Sequence[torch.Tensor],
    embed_token: Callable[[int], torch.Tensor],
) -> tuple[list[int], PromptImages]:
    """The ids of `text` laid out as PaliGemmaProcessor does for the one image `encoded`
    (encode's tokens), and the prompt's embeddings as generate() takes them."""
    if len(encoded) != 1:
        raise UsageError(f"PaliGemma takes one image a prompt, not {len(encoded)}")
    image, bos = tokenizer.token_id(IMAGE), tokenizer.bos_id
    if image is None or bos is None:
        raise TokenizerError(f"the tokenizer has no {IMAGE} or no BOS: not PaliGemma's")
    places = text.count(IMAGE)
    if places > 1:
        raise UsageError(f"the prompt marks {places} image places ({IMAGE}) for one image")
    before, _, after = text.partition(IMAGE)
    if not places:
        before, after = "", text
    soft = encoded[0]
    # Tokenized as one text, as the processor does: text after a special token is spelled
    # otherwise than on its own (no leading word-start mark, with some tokenizers).
    bos_text = tokenizer.token_to_piece(bos)
    ids = tokenizer.encode(f"{before}{IMAGE * len(soft)}{bos_text}{after}\n", add_bos=False)
    start = ids.index(image) if image in ids else len(ids)
    laid_out = ids[start : start + len(soft) + 1] == [*[image] * len(soft), bos]
    if not laid_out or ids.count(image) != len(soft):
        raise UsageError(f"the prompt holds {IMAGE} or BOS of its own")
    rows = [embed_token(t) for t in ids[:start]]
    rows += list(soft.float())
    rows += [embed_token(t) for t in ids[start + len(soft) :]]
    return ids, PrefixImages([torch.stack(rows)], [0], tuple(ids))
