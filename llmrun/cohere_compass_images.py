"""Prompts with images for Cohere Compass: Qwen2-VL's resizing, patches and M-RoPE
positions (llmrun.qwen2_vl_images; CohereCompassImageProcessor is Qwen2VLImageProcessor),
each image place that the chat template marks (<|VISION_START|><|IMAGE_PAD|><|VISION_END|>)
expanded as CohereCompassProcessor (Qwen3VLProcessor's) expands it: one <|IMAGE_PAD|> per
merged token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import qwen2_vl_images
from llmrun.qwen2_vl_images import QwenPromptImages
from llmrun.tokenizer import Tokenizer

MARKERS = ("<|VISION_START|>", "<|IMAGE_PAD|>", "<|VISION_END|>")


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], QwenPromptImages]:
    """The ids of `text` with each <|IMAGE_PAD|> repeated once per merged token of the
    image `encoded` (qwen2_vl_images.encode's tokens, deepstack features after each) in
    order, and the images as generate() takes them."""
    return qwen2_vl_images.prompt(tokenizer, text, encoded, MARKERS, "Cohere Compass")
