"""Cohere Compass's vision tower (North-Micro-Vision) from its Hugging Face folder:
CohereCompassForConditionalGeneration's config.json (model_type cohere_compass), whose
tower is Qwen3-VL's with its deepstack mergers (llmrun.models.qwen3_vl_vision, the
folder's model.visual.* tensors), and its preprocessor_config.json (a Qwen2-VL image
processor's, whose defaults it takes where the file gives none). Its images go to Cohere
Compass's language model (llmrun.models.cohere_compass_text). llama.cpp has no converter
for it: no mmproj.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import processor_settings, visual_tensors
from llmrun.loading.qwen3_vl_vision import Qwen3Vision
from llmrun.loading.vision import with_weights
from llmrun.models.qwen3_vl_vision import EncoderArgs, VisionModel

MODEL_TYPE = "cohere_compass"
TEXT_MODEL_TYPE = "cohere_compass_text"


class CompassVision(Qwen3Vision):
    """A loaded Cohere Compass vision tower and how images are prepared for it."""


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Cohere Compass's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is Cohere Compass's."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Cohere Compass mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> CompassVision:
    """Refused: there is no Cohere Compass mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Cohere Compass projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int) -> CompassVision:
    """The vision tower of a Cohere Compass folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config)
    encoder = with_weights(
        VisionModel, args, visual_tensors(path), path, (args.out_hidden_size, text_hidden)
    )
    return CompassVision(encoder, **processor_settings(path, args))
