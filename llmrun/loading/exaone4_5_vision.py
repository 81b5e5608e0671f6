"""EXAONE 4.5's vision tower: Qwen2.5-VL's (llmrun.models.qwen2_vl_vision) with
grouped-query attention, read from either format as llmrun.loading.qwen2_vl_vision reads
Qwen2.5-VL's: the Hugging Face folder (Exaone4_5_ForConditionalGeneration, model_type
exaone4_5: model.visual.* and Qwen2VLImageProcessor's preprocessor_config.json), or the
mmproj GGUF that llama.cpp's converter writes beside the text GGUF (conversion/exaone.py
Exaone4_5VisionModel: projector type exaone4_5). Its images go to an EXAONE 4 language
model (llmrun.models.exaone4), whose text and image tokens turn by their places alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmrun.loading import qwen2_vl_vision, safetensors_io
from llmrun.loading.vision import projector_type
from llmrun.models.qwen2_vl_vision import EXAONE4_5

TEXT_MODEL_TYPE = "exaone4"


class Exaone45Vision(qwen2_vl_vision.QwenVision):
    """A loaded EXAONE 4.5 vision tower (its prompts place images without M-RoPE)."""


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is EXAONE 4.5's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == EXAONE4_5 and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is EXAONE 4's (EXAONE 4.5's text model)."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is EXAONE 4.5's."""
    return projector_type(path) == qwen2_vl_vision.EXAONE4_5_PROJECTOR


def _exaone(vision: qwen2_vl_vision.QwenVision) -> Exaone45Vision:
    return Exaone45Vision(**{f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)})


def from_hf_dir(path: Path, text_hidden: int) -> Exaone45Vision:
    """The vision tower of an EXAONE 4.5 folder (f32, on the CPU)."""
    return _exaone(qwen2_vl_vision.from_hf_dir(path, text_hidden))


def from_mmproj(path: str | Path, text_hidden: int) -> Exaone45Vision:
    """The vision tower of llama.cpp's EXAONE 4.5 mmproj (projector type exaone4_5)."""
    return _exaone(qwen2_vl_vision.from_mmproj(path, text_hidden))
