"""Prompts with images, for LFM3-VL: each image resized and cut into patches as
transformers' Qwen2VLImageProcessor does (llmrun.qwen2_vl_images, whose patch order its
tower takes), encoded (llmrun.models.lfm3_vl_vision), and each image place that the chat
template marks (the config's image token, <|image_pad|> in transformers' processor,
between the template's <|vision_start|> and <|vision_end|>) expanded as Lfm3VlProcessor
expands it: one image token per merged patch, row after row. The language model turns
every token, image or text, by its place in the prompt (no M-RoPE), so an image is one
span of PromptImages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal, qwen2_vl_images
from llmrun.errors import TokenizerError
from llmrun.loading.lfm3_vl_vision import Lfm3VlVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


def image_tokens(vision: Lfm3VlVision, image) -> int:
    """How many image tokens a (Pillow) image takes, known before encoding it."""
    return qwen2_vl_images.image_tokens(vision, image)


def encode(vision: Lfm3VlVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    return [tokens.flatten(0, 1) for tokens in qwen2_vl_images.encode(vision, images)]


def prompt(
    vision: Lfm3VlVision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each image token repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    token = vision.image_token_id
    if token >= tokenizer.vocab_size:
        raise TokenizerError(
            f"the tokenizer has no image token {token} (config.json's image_token_id): "
            "not LFM3-VL's"
        )
    pad = tokenizer.token_to_piece(token)
    if tokenizer.token_id(pad) != token:
        raise TokenizerError(f"token {token} (the image token) is not a token of its own")
    return multimodal.pad_prompt(tokenizer, text, encoded, pad, "LFM3-VL")
