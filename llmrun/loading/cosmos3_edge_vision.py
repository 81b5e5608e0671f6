"""Cosmos3 Edge's image encoder (llmrun.models.cosmos3_edge_vision) from its Hugging Face
folder: Cosmos3EdgeForConditionalGeneration's config.json (model_type cosmos3_edge), the
tower's model.visual.* and the projector's model.projector.* tensors (the Hub's and
save_pretrained's attention names to_q/to_k/to_v and MLP names up_proj/down_proj, or
transformers' own in memory), and Cosmos3EdgeImageProcessor's preprocessor_config.json.
Its images go to Cosmos3 Edge's language model (llmrun.models.cosmos3_edge_text), turned
by M-RoPE. llama.cpp has no converter for it: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.loading import qwen2_vl_vision, safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.cosmos3_edge_vision import EncoderArgs, VisionModel

MODEL_TYPE = "cosmos3_edge"
TEXT_MODEL_TYPE = "cosmos3_edge_text"
# Cosmos3EdgeImageProcessor's: IMAGENET_STANDARD_MEAN and _STD, and 256x256 to 4096x4096
# pixels (its size's shortest_edge and longest_edge).
MEAN = STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 256 * 256, 4096 * 4096
_PREFIXES = {"model.visual.": "visual.", "model.projector.": "projector."}
# The checkpoint's names in a layer -> SigLIP's (llmrun.models.siglip.EncoderLayer).
_LAYER_NAMES = {
    ".self_attn.to_q.": ".self_attn.q_proj.",
    ".self_attn.to_k.": ".self_attn.k_proj.",
    ".self_attn.to_v.": ".self_attn.v_proj.",
    ".mlp.up_proj.": ".mlp.fc1.",
    ".mlp.down_proj.": ".mlp.fc2.",
}


@dataclass
class Cosmos3EdgeVision:
    """A loaded Cosmos3 Edge image encoder and how images are prepared for it."""

    encoder: VisionModel
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Cosmos3 Edge's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is Cosmos3 Edge's."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Cosmos3 Edge mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Cosmos3EdgeVision:
    """Refused: there is no Cosmos3 Edge mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Cosmos3 Edge projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Cosmos3EdgeVision:
    """The vision tower and projector of a Cosmos3 Edge folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config, text_hidden)
    weights = {}
    for name, tensor in prefixed_weights(path, _PREFIXES).items():
        for old, new in _LAYER_NAMES.items():
            name = name.replace(old, new)
        weights[name] = tensor
    encoder = with_weights(VisionModel, args, weights, path, (text_hidden, text_hidden))
    settings = qwen2_vl_vision.processor_settings(path, args, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
    return Cosmos3EdgeVision(encoder, **settings)
