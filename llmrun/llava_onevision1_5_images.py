"""Prompts with images, for LLaVA-OneVision-1.5: each image resized and cut into single-frame
patches as transformers' Qwen2VLImageProcessor does (llmrun.qwen2_vl_images), encoded by
RICE-ViT (llmrun.models.llava_onevision1_5_vision), and each image place that the chat
template marks (<|image_pad|>) expanded as its processor (Exaone4_5_Processor) expands it:
one <|image_pad|> per merged token, row after row. The language model turns every token
by its place in the prompt, so an image is one span of PromptImages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal, qwen2_vl_images
from llmrun.loading.llava_onevision1_5_vision import LlavaOnevision15Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image_pad|>"


def encode(vision: LlavaOnevision15Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    return [tokens.flatten(0, 1) for tokens in qwen2_vl_images.encode(vision, images)]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "LLaVA-OneVision-1.5")
