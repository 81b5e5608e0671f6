"""Prompts with images, for EXAONE 4.5: each image resized and cut into patches as
transformers' Qwen2VLImageProcessor does (llmrun.qwen2_vl_images, whose encoding its
Qwen2.5-VL-style tower shares), and each image place that the chat template marks
(<vision><|image_pad|></vision>) expanded as Exaone4_5_Processor expands it: one
<|image_pad|> per merged token, row after row. Unlike Qwen2-VL's, the language model turns
every token, image or text, by its place in the prompt (Exaone4_5_Model gives no M-RoPE
positions), so an image is one span of PromptImages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal, qwen2_vl_images
from llmrun.loading.exaone4_5_vision import Exaone45Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image_pad|>"


def encode(vision: Exaone45Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    return [tokens.flatten(0, 1) for tokens in qwen2_vl_images.encode(vision, images)]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "EXAONE 4.5")
