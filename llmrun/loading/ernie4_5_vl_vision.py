"""ERNIE 4.5 VL's image encoder (llmrun.models.ernie4_5_vl_vision) from its Hugging Face
folder: Ernie4_5_VLMoeForConditionalGeneration's config.json (model_type ernie4_5_vl_moe),
the tower's model.vision_model.* and the resampler's model.resampler_model.* tensors (the
Hub's names, which save_pretrained writes too), and its preprocessor_config.json (a
Qwen2-VL image processor of single frames; Ernie4_5_VLMoeImageProcessor's defaults where
the file gives none). Its images go to ERNIE 4.5 VL's language model
(llmrun.models.ernie4_5_vl_moe_text). llama.cpp has no converter for it: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import CLIP_MEAN, CLIP_STD, processor_settings
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models import ernie4_5_vl_vision
from llmrun.models.ernie4_5_vl_vision import ResamplerArgs, VisionModel
from llmrun.models.qwen2_vl_vision import QWEN2_VL, EncoderArgs

MODEL_TYPE = "ernie4_5_vl_moe"
TEXT_MODEL_TYPE = "ernie4_5_vl_moe_text"
# Ernie4_5_VLMoeImageProcessor's size: 56x56 to 28x28x6177 pixels.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 6177
_PREFIXES = {"model.vision_model.": "vision_model.", "model.resampler_model.": "resampler_model."}


@dataclass
class Ernie45VLVision:
    """A loaded ERNIE 4.5 VL image encoder and how images are prepared for it
    (Qwen2VLImageProcessor's settings, as llmrun.qwen2_vl_images reads them)."""

    encoder: VisionModel
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an ERNIE 4.5 VL's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is ERNIE 4.5 VL's."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no ERNIE 4.5 VL mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Ernie45VLVision:
    """Refused: there is no ERNIE 4.5 VL mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no ERNIE 4.5 VL projector; give its folder")


def encoder_args(config: dict[str, Any], path: Path) -> ResamplerArgs:
    """The encoder's args from an ERNIE 4.5 VL config.json dict (Ernie4_5_VLMoeVisionConfig's
    defaults where it gives none)."""
    vision, text = config.get("vision_config"), config.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text, dict) or "hidden_size" not in text:
        raise ModelFormatError(f"{path}: an ERNIE 4.5 VL config.json without its sub-configs")
    eps = vision.get("rms_norm_eps", ernie4_5_vl_vision.EPS)
    merge = vision.get("temporal_merge_size", 2)
    if eps != ernie4_5_vl_vision.EPS or merge != 2:
        raise UnsupportedError(
            f"{path}: an ERNIE 4.5 VL tower with rms_norm_eps {eps} and temporal_merge_size "
            f"{merge} (llmrun runs {ernie4_5_vl_vision.EPS} and 2)"
        )
    depth = vision.get("depth", 32)
    hidden = vision.get("hidden_size", 1280)
    tower = EncoderArgs(
        family=QWEN2_VL,
        hidden_size=hidden,
        intermediate_size=vision.get("intermediate_size", 4 * hidden),
        depth=depth,
        num_heads=vision.get("num_heads", 16),
        out_hidden_size=text["hidden_size"],
        hidden_act=vision.get("hidden_act", "quick_gelu"),
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=1,
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", 3),
        fullatt_block_indexes=tuple(range(depth)),
        rope_theta=(vision.get("rope_parameters") or {}).get("rope_theta", 10000.0),
    )
    return ResamplerArgs(tower, text["hidden_size"], text.get("rms_norm_eps", 1e-5), merge)


def from_hf_dir(path: Path, text_hidden: int) -> Ernie45VLVision:
    """The image encoder of an ERNIE 4.5 VL folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = encoder_args(config, path)
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.text_hidden_size, text_hidden))
    settings = processor_settings(path, args, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return Ernie45VLVision(encoder, **settings)
