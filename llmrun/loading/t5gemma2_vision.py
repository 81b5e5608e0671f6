"""T5Gemma 2's image encoder from its Hugging Face folder: Gemma 3's (SigLIP, pooled, normed
and projected: llmrun.models.gemma3_vision) under T5Gemma2ForConditionalGeneration's names
(model.encoder.vision_tower.*, model.encoder.multi_modal_projector.*) and config (the
encoder's vision_config, text_config and mm_tokens_per_image), images prepared as
Gemma3ImageProcessor prepares them. Its image tokens go into the encoder's input
(llmrun.models.t5gemma2). llama.cpp has no converter for it: no mmproj.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    GEMMA3_MEAN_STD,
    Vision,
    image_processor,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.gemma3_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "t5gemma2"
_PREFIXES = {
    "model.encoder.vision_tower.": "vision_tower.vision_model.",
    "model.encoder.multi_modal_projector.": "multi_modal_projector.",
}
# SiglipVisionModel's attention-pooling head, which T5Gemma 2 never runs.
_UNUSED = ".head."


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a T5Gemma 2's with its encoder's vision_config."""
    config = safetensors_io.read_config(path)
    encoder = config.get("encoder")
    return (
        config.get("model_type") == MODEL_TYPE
        and isinstance(encoder, dict)
        and isinstance(encoder.get("vision_config"), dict)
    )


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is T5Gemma 2's."""
    return config.get("model_type") == MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no T5Gemma 2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Vision:
    """Refused: there is no T5Gemma 2 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no T5Gemma 2 projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int | None) -> Vision:
    """The vision tower and projector of a T5Gemma 2 folder (f32, on the CPU), projecting
    to its encoder's width (its config's top level names no `text_hidden`)."""
    encoder = safetensors_io.read_config(path)["encoder"]
    args = EncoderArgs.from_config(encoder)
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _PREFIXES).items()
        if _UNUSED not in name
    }
    width = args.text_hidden_size
    model = with_weights(ImageEncoder, args, weights, path, (width, text_hidden or width))
    file, settings = image_processor(path)
    mean, std = (
        three_floats(settings.get(key, GEMMA3_MEAN_STD), file, key)
        for key in ("image_mean", "image_std")
    )
    return Vision(model, args.vision.image_size, mean, std)
