"""Prompts with an image, for Florence-2: the image resized and normalized as its
CLIPImageProcessor does (the Pillow backend), encoded (llmrun.models.florence2_vision), and
the prompt framed as Florence2Processor frames it: a task token (<CAPTION>, <OCR>, <OD>,
...) replaced by the question it stands for (a task that takes an input, such as
<CAPTION_TO_PHRASE_GROUNDING>, with the text after it put in), then the image's tokens,
<s>, the text, </s>. The BART encoder takes the image's tokens in place of the placeholders
(llmrun.models.bart); the framing is final (multimodal.FramedImages), not the
tokenizer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmrun.errors import TokenizerError, UsageError
from llmrun.images import normalized
from llmrun.loading.florence2_vision import Florence2Vision
from llmrun.multimodal import FramedImages
from llmrun.tokenizer import Tokenizer

# Florence2Processor's task prompts: those that stand alone, and those that take an input.
TASKS = {
    "<OCR>": "What is the text in the image?",
    "<OCR_WITH_REGION>": "What is the text in the image, with regions?",
    "<CAPTION>": "What does the image describe?",
    "<DETAILED_CAPTION>": "Describe in detail what is shown in the image.",
    "<MORE_DETAILED_CAPTION>": "Describe with a paragraph what is shown in the image.",
    "<OD>": "Locate the objects with category name in the image.",
    "<DENSE_REGION_CAPTION>": "Locate the objects in the image, with their descriptions.",
    "<REGION_PROPOSAL>": "Locate the region proposals in the image.",
}
TASKS_WITH_INPUT = {
    "<CAPTION_TO_PHRASE_GROUNDING>": "Locate the phrases in the caption: {input}",
    "<REFERRING_EXPRESSION_SEGMENTATION>": "Locate {input} in the image with mask",
    "<REGION_TO_SEGMENTATION>": "What is the polygon mask of region {input}",
    "<OPEN_VOCABULARY_DETECTION>": "Locate {input} in the image.",
    "<REGION_TO_CATEGORY>": "What is the region {input}?",
    "<REGION_TO_DESCRIPTION>": "What does the region {input} describe?",
    "<REGION_TO_OCR>": "What text is in the region {input}?",
}


def task_prompt(text: str) -> str:
    """The text Florence2Processor puts in place of a prompt's task token."""
    for token, question in TASKS.items():
        if token in text:
            if text != token:
                raise UsageError(f"Florence-2's task {token} goes alone in the prompt")
            return question
    for token, question in TASKS_WITH_INPUT.items():
        if token in text:
            return question.format(input=text.replace(token, "").strip())
    return text


def image_tokens(vision: Florence2Vision, image: Any) -> int:
    """How many prompt tokens a (Pillow) image takes: the same for every image."""
    return vision.tokens


def pixel_values(vision: Florence2Vision, image: Any) -> torch.Tensor:
    """Float32 pixels [3, height, width] of an RGB Pillow image, as the processor makes them."""
    height, width = vision.size
    if image.size != (width, height):
        image = image.resize((width, height), vision.resample)
    return normalized(image, vision.mean, vision.std)


@torch.inference_mode()
def encode(vision: Florence2Vision, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each (Pillow) image's tokens [tokens, d_model]."""
    return [vision.encoder(pixel_values(vision, image)[None])[0] for image in images]


def prompt(
    vision: Florence2Vision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], FramedImages]:
    """The encoder's ids for `text` after the one image `encoded`: the image's placeholders,
    <s>, the task's text, </s>."""
    if len(encoded) != 1:
        raise UsageError(f"Florence-2 takes one image with a prompt, not {len(encoded)}")
    if tokenizer.bos_id is None or tokenizer.eos_id is None:
        raise TokenizerError("Florence-2's tokenizer has no <s> or </s>")
    words = tokenizer.encode(task_prompt(text), add_bos=False)
    ids = [vision.image_token_id] * vision.tokens + [tokenizer.bos_id, *words, tokenizer.eos_id]
    return ids, FramedImages(list(encoded), [0])
