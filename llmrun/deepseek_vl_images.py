"""Prompts with images, for DeepSeek-VL, whose images are prepared and encoded as Janus-Pro's
(llmrun.janus_images: DeepseekVLImageProcessor is JanusImageProcessor): each image place
that the chat template marks (<image_placeholder>) repeated once per soft token, as
DeepseekVLProcessor expands it (no markers around the image, no system prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun import multimodal
from llmrun.loading.deepseek_vl_vision import DeepseekVlVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

IMAGE = "<image_placeholder>"


def image_tokens(vision: DeepseekVlVision, image) -> int:
    """How many prompt tokens an image takes: one per patch."""
    return vision.encoder.args.tokens_per_image


def prompt(
    tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <image_placeholder> repeated for the image `encoded`
    (encode's tokens) in order, and the images as generate() takes them."""
    return multimodal.pad_prompt(tokenizer, text, encoded, IMAGE, "DeepSeek-VL")
