"""VideoLLaMA3's image encoder (llmrun.models.video_llama_3_vision) from its Hugging Face
folder: VideoLlama3ForConditionalGeneration's config.json (model_type video_llama_3), the
tower's model.vision_model.* and the projector's model.projector.* tensors, and its
preprocessor_config.json (a Qwen2-VL image processor of single frames, each patch a token:
VideoLlama3ImageProcessor's defaults where the file gives none). Its images go to its
Qwen2 language model, every token turned by its place. llama.cpp has no converter for it:
no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import MAX_PIXELS, MIN_PIXELS, processor_settings
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.video_llama_3_vision import EncoderArgs, VisionModel

MODEL_TYPE = "video_llama_3"
# VideoLlama3ImageProcessor's mean and std (IMAGENET_STANDARD_*); its pixel limits are
# Qwen2VLImageProcessor's.
MEAN = STD = (0.5, 0.5, 0.5)
_PREFIXES = {"model.vision_model.": "vision_model.", "model.projector.": "projector."}


@dataclass
class VideoLlama3Vision:
    """A loaded VideoLLaMA3 image encoder and how images are prepared for it
    (Qwen2VLImageProcessor's settings, as llmrun.qwen2_vl_images reads them)."""

    encoder: VisionModel
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a VideoLLaMA3's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen2's, VideoLLaMA3's."""
    return text_config.get("model_type") == "qwen2"


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no VideoLLaMA3 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> VideoLlama3Vision:
    """Refused: there is no VideoLLaMA3 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no VideoLLaMA3 projector; give its folder")


def encoder_args(config: dict[str, Any], text_hidden: int, path: Path) -> EncoderArgs:
    """The encoder's args from a VideoLLaMA3 config.json dict (VideoLlama3VisionConfig's,
    SigLIP's, defaults where it gives none)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelFormatError(f"{path}: a VideoLLaMA3 config.json without a vision_config")
    rope = vision.get("rope_parameters") or {}
    return EncoderArgs(
        hidden_size=vision.get("hidden_size", 768),
        intermediate_size=vision.get("intermediate_size", 3072),
        num_hidden_layers=vision.get("num_hidden_layers", 12),
        num_attention_heads=vision.get("num_attention_heads", 12),
        out_hidden_size=text_hidden,
        patch_size=vision.get("patch_size", 16),
        num_channels=vision.get("num_channels", 3),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=rope.get("rope_theta", 10000.0),
    )


def from_hf_dir(path: Path, text_hidden: int) -> VideoLlama3Vision:
    """The image encoder of a VideoLLaMA3 folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    text = config.get("text_config") or {}
    args = encoder_args(config, text.get("hidden_size", text_hidden), path)
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.out_hidden_size, text_hidden))
    return VideoLlama3Vision(encoder, **processor_settings(path, args, MEAN, STD))
