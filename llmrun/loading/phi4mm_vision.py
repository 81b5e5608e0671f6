"""Phi-4-multimodal's image encoder (SigLIP tower, HD crops, MLP projector) from its Hugging
Face folder (Phi4MultimodalForCausalLM; preprocessor_config.json says how images are
cropped). llama.cpp's converter has no Phi-4-multimodal (its Phi-4 vision mmproj is
Phi-4-reasoning-vision's), so the folder is the one format; the language model (Phi-3)
loads as for text (llmrun.loading.vl_text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models import phi4mm_vision

MODEL_TYPE = "phi4_multimodal"
_HF_PREFIXES = {"model.embed_tokens_extend.image_embed.": ""}
# SigLIP's post-norm and pooling head, which the image embedding never runs, and the
# layers past feature_layer.
_UNUSED = ("img_processor.post_layernorm.", "img_processor.head.")
# Phi4MultimodalImageProcessor's defaults.
_MEAN_STD = (0.5, 0.5, 0.5)
_DYNAMIC_HD = 36
# The processor counts an image's tokens for a global view of 16 x 16 soft tokens
# (_get_num_image_tokens: 256 + 16), whatever the crop and patch sizes.
_GLOBAL_SIDE = 16


@dataclass
class Phi4mmVision:
    """A loaded Phi-4-multimodal image encoder and how images are cut for it: crops of
    `crop` pixels (patches of `patch`), at most `max_crops` of them (dynamic_hd) before the
    grid of the nearest aspect is taken, normalized by mean and std; each image place is
    the token of `image_token_id`."""

    encoder: phi4mm_vision.ImageEncoder
    crop: int
    patch: int
    max_crops: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_token_id: int


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is Phi-4-multimodal's with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "phi3"


def is_mmproj(path: str | Path) -> bool:
    """No mmproj GGUF holds this encoder: llama.cpp does not convert it."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Phi4mmVision:
    """Refused: is_mmproj takes no file."""
    raise UnsupportedError(f"{path}: llmrun takes Phi-4-multimodal's images from its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Phi4mmVision:
    """The image encoder of a Phi-4-multimodal Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Phi-4-multimodal folder with a vision_config")
    args = phi4mm_vision.EncoderArgs.from_config(config)
    if args.side != _GLOBAL_SIDE:
        raise UnsupportedError(
            f"{path}: a crop of {args.side}x{args.side} soft tokens; Phi-4-multimodal's "
            f"processor counts {_GLOBAL_SIDE}x{_GLOBAL_SIDE} (crop_size 448, patch_size 14)"
        )
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _HF_PREFIXES).items()
        if not name.startswith(_UNUSED) and _layer_runs(name, args.layers)
    }
    encoder = with_weights(
        phi4mm_vision.ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden)
    )
    image_token = config["vision_config"].get("image_token_id")
    if image_token is None:
        image_token = phi4mm_vision.VISION_DEFAULTS["image_token_id"]
    return Phi4mmVision(encoder, **_processor_settings(path, args), image_token_id=image_token)


def _layer_runs(name: str, layers: int) -> bool:
    """Whether a tower weight is of a layer before feature_layer (or not of a layer)."""
    parts = name.split(".")
    if parts[:3] != ["img_processor", "encoder", "layers"]:
        return True
    return int(parts[3]) < layers


def _processor_settings(path: Path, args: phi4mm_vision.EncoderArgs) -> dict[str, Any]:
    """The image processor's crop size, patch size, dynamic_hd and normalization, else
    Phi4MultimodalImageProcessor's defaults; crops must be the tower's crop_size and
    patches its patch_size."""
    source, settings = image_processor(path)
    crop = args.crop_size
    size = settings.get("size", {"height": crop, "width": crop})
    if not isinstance(size, dict) or size.get("height") != crop or size.get("width") != crop:
        raise ModelFormatError(
            f"{source}: size is {size!r}, not square crops of the vision tower's {crop} pixels"
        )
    patch = settings.get("patch_size", args.vision.patch_size)
    if patch != args.vision.patch_size:
        raise ModelFormatError(
            f"{source}: patch_size is {patch!r}, not the vision tower's {args.vision.patch_size}"
        )
    max_crops = settings.get("dynamic_hd", _DYNAMIC_HD)
    if not positive_int(max_crops):
        raise ModelFormatError(f"{source}: dynamic_hd is {max_crops!r}, not a positive integer")
    return dict(
        crop=crop,
        patch=patch,
        max_crops=max_crops,
        mean=three_floats(settings.get("image_mean", _MEAN_STD), source, "image_mean"),
        std=three_floats(settings.get("image_std", _MEAN_STD), source, "image_std"),
    )
