"""LFM3-VL's vision tower and projector (llmrun.models.lfm3_vl_vision) from its Hugging
Face folder (Lfm3VlForConditionalGeneration, model_type lfm3_vl): model.vision_tower.* and
model.multi_modal_projector.* under the Hub's names, and the image processor's settings
(Qwen2VLImageProcessor's, the class transformers' auto classes give lfm3_vl) from
preprocessor_config.json or processor_config.json. Its images go to an LFM3 language
model (llmrun.models.lfm3), whose text and image tokens turn by their places alone.

llama.cpp has neither an "lfm3" text arch nor an LFM3-VL projector (its converter's
conversion/lfm2.py converts LFM2-VL only): Hugging Face folders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import CLIP_MEAN, CLIP_STD, MAX_PIXELS, MIN_PIXELS
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.lfm3_vl_vision import EncoderArgs, VisionModel

MODEL_TYPE, TEXT_MODEL_TYPE = "lfm3_vl", "lfm3"
IMAGE_TOKEN_ID = 125_030  # Lfm3VlConfig's default
# Checkpoint key prefixes (transformers 5's layout, and the older one without model.).
_HF_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


@dataclass
class Lfm3VlVision:
    """A loaded LFM3-VL vision tower, how images are prepared for it (Qwen2VLImageProcessor's
    settings) and the id of the token each merged patch takes in a prompt."""

    encoder: VisionModel
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_pixels: int
    max_pixels: int
    image_token_id: int


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is LFM3-VL's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is LFM3's (LFM3-VL's text model)."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    """No mmproj holds LFM3-VL's tower (see the module's note)."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Lfm3VlVision:
    """Refused: is_mmproj takes no file (see the module's note)."""
    raise UnsupportedError(f"{path}: llmrun takes LFM3-VL's images from its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Lfm3VlVision:
    """The vision tower and projector of an LFM3-VL folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    try:
        args = EncoderArgs.from_config(config, text_hidden)
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None
    image_token = config.get("image_token_id", IMAGE_TOKEN_ID)
    if not positive_int(image_token):
        raise ModelFormatError(f"{path}: image_token_id is {image_token!r}")
    encoder = with_weights(
        VisionModel, args, prefixed_weights(path, _HF_PREFIXES), path, (text_hidden, text_hidden)
    )
    return Lfm3VlVision(encoder, **_processor_settings(path, args), image_token_id=image_token)


def _processor_settings(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """The image processor's mean, std and pixel limits (Qwen2VLImageProcessor's defaults
    where it gives none), its patch sizes checked against the tower's."""
    source, settings = image_processor(path)
    for key, expected in (
        ("patch_size", args.patch_size),
        ("merge_size", args.spatial_merge_size),
        ("temporal_patch_size", args.temporal_patch_size),
    ):
        if settings.get(key, expected) != expected:
            raise ModelFormatError(
                f"{source}: {key} is {settings[key]!r}, but the vision tower's is {expected}"
            )
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    limits = []
    for key, alias, default in (
        ("min_pixels", "shortest_edge", MIN_PIXELS),
        ("max_pixels", "longest_edge", MAX_PIXELS),
    ):
        value = settings.get(key, size.get(alias, default))
        if not positive_int(value):
            raise ModelFormatError(f"{source}: {key} is {value!r}")
        limits.append(value)
    if limits[0] > limits[1]:
        raise ModelFormatError(f"{source}: min_pixels {limits[0]} > max_pixels {limits[1]}")
    return dict(
        mean=three_floats(settings.get("image_mean", CLIP_MEAN), source, "image_mean"),
        std=three_floats(settings.get("image_std", CLIP_STD), source, "image_std"),
        min_pixels=limits[0],
        max_pixels=limits[1],
    )
