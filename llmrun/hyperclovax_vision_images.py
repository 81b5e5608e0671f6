"""Prompts with images, for HyperCLOVA X SEED Vision: each image resized and cut into
patches as transformers' Qwen2VLImageProcessor does (llmrun.qwen2_vl_images, whose
Qwen2.5-VL tower it shares), and each <|image_pad|> of the prompt repeated once per merged
token, row after row, as HyperCLOVAXVisionV2Processor (EXAONE 4.5's) expands it. Its
language model turns every token, image or text, by its place in the prompt
(HyperCLOVAXVisionV2Model gives no M-RoPE positions), so an image is one span of
PromptImages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal, qwen2_vl_images
from llmrun.loading.hyperclovax_vision import HyperclovaxVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image_pad|>"


def encode(vision: HyperclovaxVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    return [tokens.flatten(0, 1) for tokens in qwen2_vl_images.encode(vision, images)]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "HyperCLOVA X SEED Vision")
