"""Prompts with images for ERNIE 4.5 VL: Qwen2-VL's resizing, patches (of single frames)
and M-RoPE positions (llmrun.qwen2_vl_images; Ernie4_5_VLMoeImageProcessor is
Qwen2VLImageProcessor's with temporal_patch_size 1 and its own pixel limits; get_rope_index
places an image's tokens as Qwen2-VL's), each image place that the chat template marks
(<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>) expanded as Ernie4_5_VLMoeProcessor
expands it: one <|IMAGE_PLACEHOLDER|> per merged token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import qwen2_vl_images
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

MARKERS = ("<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>")


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|IMAGE_PLACEHOLDER|> repeated once per merged token of
    the image `encoded` (qwen2_vl_images.encode's tokens) in order, and the images as
    generate() takes them."""
    return qwen2_vl_images.prompt(tokenizer, text, encoded, MARKERS, "ERNIE 4.5 VL")
