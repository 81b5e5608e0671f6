"""Ovis2's visual tokenizer (llmrun.models.ovis2_vision) from its Hugging Face folder:
Ovis2ForConditionalGeneration's config.json (model_type ovis2; its image and indicator
token ids), the model.vision_tower.* and model.visual_embeddings_table.* tensors, and
Ovis2ImageProcessor's preprocessor_config.json (tile size, tiling, mean and std). Its
images go to a Qwen2 language model (llmrun.models.qwen2). llama.cpp has no converter for
it: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.ovis2_vision import EncoderArgs, VisionModel

MODEL_TYPE = "ovis2"
TEXT_MODEL_TYPE = "qwen2"
# Ovis2ImageProcessor's defaults: OPENAI_CLIP_MEAN and _STD.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
# Ovis2Config's defaults.
IMAGE_TOKEN_ID = 151665
INDICATOR_TOKEN_IDS = (151666, 151667, 151668, 151669, 151670)
BICUBIC = 3  # PILImageResampling, the processor's resample
_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "model.visual_embeddings_table.": "visual_embeddings_table.",
}


@dataclass
class Ovis2Vision:
    """A loaded Ovis2 visual tokenizer, how images are cut into tiles for it and the ids
    of the tokens that place an image in a prompt."""

    encoder: VisionModel
    image_token_id: int
    indicator_token_ids: tuple[int, ...]
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    # Ovis2ImageProcessor's tiling: off, or up to max_patches tiles (and a thumbnail).
    crop_to_patches: bool = False
    min_patches: int = 1
    max_patches: int = 12
    use_covering_area_grid: bool = True


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an Ovis2's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen2's (Ovis2's text model)."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Ovis2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Ovis2Vision:
    """Refused: there is no Ovis2 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Ovis2 projector; give its folder")


def _token_ids(config: dict[str, Any], path: Path, args: EncoderArgs) -> dict[str, Any]:
    image = config.get("image_token_id", IMAGE_TOKEN_ID)
    indicators = config.get("visual_indicator_token_ids", INDICATOR_TOKEN_IDS)
    ok = isinstance(indicators, list | tuple) and all(positive_int(i) for i in indicators)
    if not positive_int(image) or not ok:
        raise ModelFormatError(f"{path}: config.json's image or visual indicator token ids")
    if len(indicators) != args.num_visual_indicator_tokens:
        raise ModelFormatError(
            f"{path}: {len(indicators)} visual_indicator_token_ids for "
            f"{args.num_visual_indicator_tokens} visual indicator tokens"
        )
    return {"image_token_id": image, "indicator_token_ids": tuple(indicators)}


def _tiling(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """The processor's mean, std and tiling; its tile size must be the tower's image_size."""
    source, settings = image_processor(path)
    size = settings.get("size") or {"height": 384, "width": 384}
    if size != {"height": args.image_size, "width": args.image_size}:
        raise ModelFormatError(
            f"{source}: size {size!r}, but the vision tower takes tiles of "
            f"{args.image_size}x{args.image_size}"
        )
    if settings.get("resample", BICUBIC) != BICUBIC or settings.get("do_center_crop"):
        raise UnsupportedError(f"{source}: resampling other than bicubic, or a center crop")
    tiling = {}
    for key, default in (("min_patches", 1), ("max_patches", 12)):
        value = settings.get(key, default)
        if not positive_int(value):
            raise ModelFormatError(f"{source}: {key} is {value!r}")
        tiling[key] = value
    for key, default in (("crop_to_patches", False), ("use_covering_area_grid", True)):
        tiling[key] = bool(settings.get(key, default))
    return dict(
        mean=three_floats(settings.get("image_mean", MEAN), source, "image_mean"),
        std=three_floats(settings.get("image_std", STD), source, "image_std"),
        **tiling,
    )


def from_hf_dir(path: Path, text_hidden: int) -> Ovis2Vision:
    """The visual tokenizer of an Ovis2 folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    try:
        args = EncoderArgs.from_config(config)
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.text_hidden_size, text_hidden))
    return Ovis2Vision(encoder, **_token_ids(config, path, args), **_tiling(path, args))
