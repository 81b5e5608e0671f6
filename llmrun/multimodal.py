"""Prompts with images, for Gemma 3: each image place that the chat template marks
(<start_of_image>) expanded into the image's soft tokens as Gemma3Processor expands it,
the images encoded, and where their embeddings go in the prompt, which the prefill
(llmrun.generate) hands the model chunk by chunk, an image never split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import pixel_values
from llmrun.loading.vision import Vision
from llmrun.models.gemma3 import ImageTokens
from llmrun.tokenizer import Tokenizer

IMAGE_START, IMAGE_END, IMAGE_SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


@dataclass
class PromptImages:
    """The images of a prompt: each one's embeddings [tokens, hidden] and the index in
    the prompt of its first soft token."""

    embeds: list[torch.Tensor]
    starts: list[int]
    # Whether the server's prefix cache may give a prompt with these images its leading
    # blocks (Llama 3.2 Vision's may not: its image's state is not in them).
    prefix_cached: ClassVar[bool] = True
    # Whether the prompt's ids are framed already (an image-to-text encoder-decoder's
    # processor put its image before the tokenizer's frame: Florence-2's), so that
    # llmrun.text_to_text adds no frame of its tokenizer's.
    framed: ClassVar[bool] = False

    @property
    def first(self) -> int:
        """Where the first image begins: a cached prefix is reused up to there at most (a
        cache holds placeholders, which do not say which image it saw)."""
        return self.starts[0]

    def spans(self) -> list[tuple[int, int]]:
        return [(s, s + len(e)) for s, e in zip(self.starts, self.embeds, strict=True)]

    def salt(self) -> bytes:
        """What the cached keys and values of the images' first block depend on besides
        the images and the tokens up to there: nothing here (PaliGemma's images see its
        whole prompt: paligemma_images)."""
        return b""

    def shift_at(self, position: int) -> int:
        """How far the RoPE position of a text token at `position` lies before its place:
        none here (Qwen2-VL's images shift the text after them: qwen2_vl_images)."""
        return 0

    def wholes(self) -> list[tuple[int, int]]:
        """The stretches of the prompt a prefill chunk must hold whole: each image's span
        (Molmo 2's images see each other, so all of them together: molmo2_images)."""
        return self.spans()

    def cuts(self, cuts: Sequence[int], offset: int) -> list[int]:
        """Prefill chunk starts (indexes into the tokens fed, which begin at prompt index
        `offset`) without those that would split an image."""
        return [c for c in cuts if not any(a < c + offset < b for a, b in self.wholes())]

    def tokens(self, begin: int, end: int, device: torch.device) -> ImageTokens | None:
        """What the forward of prompt[begin:end] takes of the images; None if none."""
        groups = torch.full((end - begin,), -1, dtype=torch.long)
        embeds = []
        for index, (a, b) in enumerate(self.spans()):
            if begin <= a and b <= end:
                groups[a - begin : b - begin] = index
                embeds.append(self.embeds[index])
            elif a < end and begin < b:
                raise ValueError(f"a forward of tokens {begin}..{end} splits image {index}")
        if not embeds:
            return None
        return ImageTokens(torch.cat(embeds).to(device), groups.to(device))


class FramedImages(PromptImages):
    """An image-to-text encoder-decoder's images whose prompt its processor framed already
    (Florence-2's image before <s>; TrOCR's image alone)."""

    framed: ClassVar[bool] = True


def _soft_token(tokenizer: Tokenizer) -> int:
    """The id of <image_soft_token>, where the tokenizer has Gemma 3's three image tokens
    (without them the markers would be read as plain text)."""
    markers = (IMAGE_START, IMAGE_END, IMAGE_SOFT)
    missing = [text for text in markers if tokenizer.token_id(text) is None]
    if missing:
        raise TokenizerError(f"the tokenizer has no {', '.join(missing)}: not Gemma 3's")
    return tokenizer.token_id(IMAGE_SOFT)


def expand(
    tokenizer: Tokenizer, text: str, images: int, per_image: int
) -> tuple[list[int], list[int]]:
    """The ids of `text` with each <start_of_image> expanded as Gemma3Processor does
    ("\\n\\n<start_of_image>", the image's soft tokens, "<end_of_image>\\n\\n"), and the
    index of each image's first soft token. The text must mark exactly `images` places."""
    soft = _soft_token(tokenizer)
    places = text.count(IMAGE_START)
    if places != images:
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({IMAGE_START}) "
            f"for {images} image{'s' * (images != 1)}: write {IMAGE_START} where each goes"
        )
    expanded = text.replace(
        IMAGE_START, f"\n\n{IMAGE_START}{IMAGE_SOFT * per_image}{IMAGE_END}\n\n"
    )
    ids = tokenizer.encode(expanded)
    starts = [i for i, t in enumerate(ids) if t == soft and (i == 0 or ids[i - 1] != soft)]
    if len(starts) != images or ids.count(soft) != images * per_image:
        raise UsageError(f"the prompt holds {IMAGE_SOFT} of its own: remove it")
    return ids, starts


def pad_prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor], pad: str, family: str
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each image place `pad` (one token of `family`'s tokenizer)
    repeated once per token of the image `encoded`, in order, and the images as generate()
    takes them. The text must mark exactly as many places as there are images."""
    token = tokenizer.token_id(pad)
    if token is None:
        raise TokenizerError(f"the tokenizer has no {pad}: not {family}'s")
    places = text.count(pad)
    if places != len(encoded):
        raise UsageError(
            f"the prompt marks {places} image place{'s' * (places != 1)} ({pad}) for "
            f"{len(encoded)} image{'s' * (len(encoded) != 1)}: write {pad} where each goes"
        )
    pieces = text.split(pad)
    expanded = pieces[0] + "".join(
        pad * len(e) + piece for e, piece in zip(encoded, pieces[1:], strict=True)
    )
    ids = tokenizer.encode(expanded)
    # Each image's tokens begin where the run of pads of the one before ends.
    starts, at = [], 0
    for e in encoded:
        at = ids.index(token, at) if token in ids[at:] else len(ids)
        starts.append(at)
        at += len(e)
    runs_hold = all(
        ids[s : s + len(e)] == [token] * len(e) for s, e in zip(starts, encoded, strict=True)
    )
    if not runs_hold or ids.count(token) != sum(len(e) for e in encoded):
        raise UsageError(f"the prompt holds {pad} of its own")
    return ids, PromptImages(list(encoded), starts)


@torch.inference_mode()
def encode(vision: Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [tokens, hidden], encoded one at a time (the
    attention over an 896-pixel image's 4096 patches is what takes memory)."""
    out = []
    for image in images:
        pixels = pixel_values(image, vision.image_size, vision.mean, vision.std)
        out.append(vision.encoder(pixels[None])[0])
    return out
