"""HyperCLOVA X SEED Vision's image encoder (llmrun.models.hyperclovax_vision) from its
Hugging Face folder: HyperCLOVAXVisionV2ForConditionalGeneration's config.json (model_type
hyperclovax_vision_v2, or the Hub's own "vlm" with a Qwen2.5-VL vision_config), the tower's
model.vision_model.* tensors and the projector's (model.vision_projector.* as the Hub and
save_pretrained write it, model.projector.* as transformers names it in memory), and
Qwen2VLImageProcessor's preprocessor_config.json. Its images go to a HyperCLOVA X SEED
language model (llmrun.models.hyperclovax). llama.cpp has no converter for it: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import qwen2_vl_vision, safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.hyperclovax_vision import EncoderArgs, VisionModel
from llmrun.models.qwen2_vl_vision import QWEN2_5_VL

MODEL_TYPE = "hyperclovax_vision_v2"
HUB_MODEL_TYPE = "vlm"  # the Hub's config.json, which transformers reads as MODEL_TYPE
TEXT_MODEL_TYPE = "hyperclovax"
_VISION_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
_PREFIXES = {
    "model.vision_model.": "vision_model.",
    "model.vision_projector.": "projector.",
    "model.projector.": "projector.",
}


@dataclass
class HyperclovaxVision(qwen2_vl_vision.QwenVision):
    """A loaded HyperCLOVA X SEED Vision encoder (its prompts place images without M-RoPE)."""


def is_config(config: dict[str, Any]) -> bool:
    """Whether a config.json dict is HyperCLOVA X SEED Vision's (under either model_type)."""
    kind = config.get("model_type")
    vision = config.get("vision_config")
    if kind == HUB_MODEL_TYPE:
        text = config.get("text_config")
        return (
            isinstance(vision, dict)
            and vision.get("model_type") in _VISION_TYPES
            and isinstance(text, dict)
            and text.get("model_type") == TEXT_MODEL_TYPE
        )
    return kind == MODEL_TYPE and isinstance(vision, dict)


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a HyperCLOVA X SEED Vision's with its vision_config."""
    return is_config(safetensors_io.read_config(path))


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is HyperCLOVA X SEED's."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no HyperCLOVA X SEED Vision mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> HyperclovaxVision:
    """Refused: there is no HyperCLOVA X SEED Vision mmproj to read."""
    raise UnsupportedError(
        f"{path}: llama.cpp has no HyperCLOVA X SEED Vision projector; give its folder"
    )


def from_hf_dir(path: Path, text_hidden: int) -> HyperclovaxVision:
    """The vision tower and projector of a HyperCLOVA X SEED Vision folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(text.get("hidden_size"), int):
        raise ModelFormatError(
            f"{path}: a HyperCLOVA X SEED Vision config.json without text_config.hidden_size"
        )
    tower = qwen2_vl_vision.EncoderArgs.from_config({**config, "model_type": QWEN2_5_VL})
    args = EncoderArgs(**vars(tower), text_hidden_size=text["hidden_size"])
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.text_hidden_size, text_hidden))
    return HyperclovaxVision(encoder, **qwen2_vl_vision.processor_settings(path, args))
