"""Prompts with an image, for BLIP-2 and InstructBLIP: the image prepared as BlipImageProcessor does (its
Pillow backend: resized to the tower's square, bicubic; / 255, (x - mean) / std), encoded
(llmrun.models.blip2_vision), and its query tokens put before the whole prompt, before
even its BOS, as Blip2Processor puts them (the text's special tokens as its tokenizer adds
them: a tokenizer.json's post-processor): one image a prompt, whatever the text says.
InstructBLIP's Q-Former reads the prompt too, so its images are encoded to the vision
tower's states and read with the text where the prompt is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrun.errors import UsageError
from llmrun.images import normalized
from llmrun.loading.blip2_vision import Blip2Vision, InstructBlipVision
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer


def pixel_values(image, vision: Blip2Vision) -> torch.Tensor:
    """Float32 pixels [3, S, S] of an RGB Pillow image, S the tower's image size."""
    from PIL import Image

    side = vision.image_size
    resized = image.resize((side, side), Image.Resampling(vision.resample))
    return normalized(resized, vision.mean, vision.std)


def image_tokens(vision: Blip2Vision, image) -> int:
    """How many prompt tokens an image takes: the Q-Former's queries."""
    return vision.encoder.args.num_query_tokens


@torch.inference_mode()
def encode(vision: Blip2Vision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's soft tokens [queries, hidden], encoded one at a time."""
    return [vision.encoder(pixel_values(image, vision)[None])[0] for image in images]


@torch.inference_mode()
def encode_for_instructblip(vision: InstructBlipVision, images: Sequence) -> list[torch.Tensor]:
    """Each (Pillow) image's vision-tower states [patches + 1, width]: InstructBLIP's
    Q-Former reads them with the prompt (instructblip_prompt)."""
    return [vision.encoder.vision_model(pixel_values(image, vision)[None])[0] for image in images]


@torch.inference_mode()
def instructblip_prompt(
    vision: InstructBlipVision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """prompt's, the image's soft tokens read by the Q-Former from the image `encoded`
    (encode_for_instructblip's states) and `text` in the Q-Former tokenizer's ids, as
    InstructBlipProcessor gives them."""
    _one_image(encoded)
    text_ids = vision.qformer_tokenizer.encode_sequence(text)
    limit = vision.encoder.args.qformer.max_position_embeddings
    if len(text_ids) > limit:
        raise UsageError(
            f"the prompt is {len(text_ids)} tokens in the Q-Former's vocabulary, over its "
            f"{limit} positions"
        )
    tokens = vision.encoder.read(encoded[0][None], torch.tensor([text_ids]))[0]
    return prompt(vision, tokenizer, text, [tokens])


def _one_image(encoded: Sequence[torch.Tensor]) -> None:
    if len(encoded) != 1:
        raise UsageError(f"BLIP-2 takes one image a prompt, not {len(encoded)}")


def prompt(
    vision: Blip2Vision, tokenizer: Tokenizer, text: str, encoded: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of the image `encoded` (encode's tokens) then of `text`, and the image as
    generate() takes it."""
    _one_image(encoded)
    ids = tokenizer.encode_sequence(text)  # with the special tokens Blip2Processor's tokenizer adds
    if vision.image_token_id in ids:
        raise UsageError("the prompt holds BLIP-2's image token of its own: remove it")
    return [vision.image_token_id] * len(encoded[0]) + ids, PromptImages(list(encoded), [0])
