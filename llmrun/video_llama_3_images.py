"""Prompts with images for VideoLLaMA3: Qwen2-VL's resizing (sides of whole patches) and
patches of single frames, each patch a token (llmrun.qwen2_vl_images with merge size 1:
VideoLlama3ImageProcessor's), each image place the chat template marks (<|image_pad|>)
repeated once per token, as VideoLlama3Processor expands it; every token turned by its
place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal, qwen2_vl_images
from llmrun.loading.video_llama_3_vision import VideoLlama3Vision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<|image_pad|>"


def encode(vision: VideoLlama3Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [rows * columns, hidden], encoded one at a time."""
    return [tokens.flatten(0, 1) for tokens in qwen2_vl_images.encode(vision, images)]


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <|image_pad|> repeated for the image `encoded` (encode's
    tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "VideoLLaMA3")
