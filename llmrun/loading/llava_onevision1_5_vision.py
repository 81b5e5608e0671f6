"""LLaVA-OneVision-1.5's vision tower (llmrun.models.llava_onevision1_5_vision) from the
Hugging Face folder of a LlavaOnevision15ForConditionalGeneration (the Deep-VLM `-hf`
repos, as they and save_pretrained write it: visual.*) with Qwen2VLImageProcessor's
preprocessor_config.json (temporal_patch_size 1: the tower takes single frames). Its
images go to a Qwen3 language model, every token turned by its place in the prompt.
llama.cpp's converter writes no mmproj for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import qwen2_vl_vision, safetensors_io
from llmrun.loading.vision import positive_int, prefixed_weights, with_weights
from llmrun.models.llava_onevision1_5_vision import EncoderArgs, VisionModel
from llmrun.models.qwen2_vl_vision import QWEN2_VL

MODEL_TYPE = "llava_onevision1_5"
TEXT_MODEL_TYPE = "qwen3"
_HF_PREFIXES = {"model.visual.": "", "visual.": ""}


class LlavaOnevision15Vision(qwen2_vl_vision.QwenVision):
    """A loaded LLaVA-OneVision-1.5 vision tower (its prompts place images without
    M-RoPE)."""


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a LLaVA-OneVision-1.5's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen3's (LLaVA-OneVision-1.5's text)."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no LLaVA-OneVision-1.5 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> LlavaOnevision15Vision:
    """Refused: there is no LLaVA-OneVision-1.5 mmproj to read."""
    raise UnsupportedError(
        f"{path}: llama.cpp has no LLaVA-OneVision-1.5 projector; give its folder"
    )


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The tower's shape from the config.json (LlavaOnevision15VisionConfig's defaults
    where it leaves fields out)."""
    vision = config["vision_config"]
    rope = vision.get("rope_parameters") or {}
    if vision.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedError(f"{path}: vision_config.hidden_act {vision['hidden_act']!r}")
    fields = dict(
        hidden_size=vision.get("hidden_size", 1024),
        intermediate_size=vision.get("intermediate_size", 4096),
        depth=vision.get("depth", 24),
        num_heads=vision.get("num_heads", 16),
        out_hidden_size=vision.get("out_hidden_size", 4096),
        patch_size=vision.get("patch_size", 14),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", 3),
    )
    for name, value in fields.items():
        if not positive_int(value):
            raise ModelFormatError(f"{path}: vision_config.{name} is {value!r}")
    return EncoderArgs(
        family=QWEN2_VL,
        hidden_act="gelu",
        temporal_patch_size=1,
        rope_theta=rope.get("rope_theta", 10000.0),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
        **fields,
    )


def from_hf_dir(path: Path, text_hidden: int) -> LlavaOnevision15Vision:
    """The vision tower of a LLaVA-OneVision-1.5 folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a LLaVA-OneVision-1.5 folder with a vision_config")
    args = encoder_args(config, path)
    processor = qwen2_vl_vision.processor_settings(path, args)
    weights = prefixed_weights(path, _HF_PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.out_hidden_size, text_hidden))
    return LlavaOnevision15Vision(encoder, **processor)
