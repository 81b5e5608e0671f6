"""DeepSeek-VL's image encoder from the Hugging Face folder of a
DeepseekVLForConditionalGeneration: a SigLIP tower (a SiglipVisionModel, its weights
model.vision_model.* as transformers 5 saves them, or under the SiglipVisionModel's own
nesting, model.vision_model.vision_model.*; its attention-pooling head is never read, as DeepseekVLModel takes the
patches' last hidden states) and an aligner of two Linears with a
GELU between (model.aligner.linear1, linear2). That is Janus-Pro's encoder with a two-layer
aligner, so it loads as llmrun.models.janus_vision's under its names; the images are
prepared as Janus-Pro's too (DeepseekVLImageProcessor is JanusImageProcessor). Folders only:
llama.cpp has no converter for DeepSeek-VL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.janus_vision import JanusVision, processor_settings
from llmrun.loading.vision import with_weights
from llmrun.models import siglip
from llmrun.models.janus_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "deepseek_vl"
_TOWER = "model.vision_model."
# SiglipVisionConfig's defaults for the fields siglip.VisionArgs has no default for.
_SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
}
_NAMES = {
    "model.aligner.linear1.": "aligner.fc1.",
    "model.aligner.linear2.": "aligner.hidden_layers.0.",
}


@dataclass
class DeepseekVlVision(JanusVision):
    """A loaded DeepSeek-VL image encoder and JanusImageProcessor's settings for it; its
    prompts have no system prompt and no markers around an image's tokens."""


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a DeepSeek-VL with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no DeepSeek-VL mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> DeepseekVlVision:
    """Refused: there is no DeepSeek-VL mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no DeepSeek-VL projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is DeepSeek-VL's kind: a Llama."""
    return config.get("model_type") == "llama"


def siglip_args(config: dict[str, Any]) -> siglip.VisionArgs:
    """The SigLIP tower's shape from a DeepseekVLConfig dict's vision_config (a
    SiglipVisionConfig's, its defaults where fields are left out)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelFormatError("a DeepSeek-VL config without a vision_config")
    kind = vision.get("model_type", "siglip_vision_model")
    if kind != "siglip_vision_model":
        raise UnsupportedError(f"a DeepSeek-VL vision tower of type {kind!r}; SigLIP's is read")
    return siglip.VisionArgs.from_config({**_SIGLIP_DEFAULTS, **vision})


def encoder_args(config: dict[str, Any], text_hidden: int) -> EncoderArgs:
    """The encoder's shape from a DeepseekVLConfig dict: the SigLIP tower, the aligner as
    wide as the language model, GELU (nn.GELU, exact) between its two Linears."""
    return EncoderArgs(siglip_args(config), text_hidden, depth=2, hidden_act="gelu")


def from_hf_dir(path: Path, text_hidden: int) -> DeepseekVlVision:
    """DeepSeek-VL's image encoder from its Hugging Face folder (f32, on the CPU)."""
    if not folder_has_vision(path):
        raise ModelFormatError(f"{path}: not a DeepSeek-VL folder with a vision_config")
    args = encoder_args(safetensors_io.read_config(path), text_hidden)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name)
            if new is not None:
                weights[new] = tensor
    first = weights.get("aligner.fc1.weight")
    width = first.shape[0] if first is not None and first.dim() == 2 else text_hidden
    encoder = with_weights(ImageEncoder, args, weights, path, (width, text_hidden))
    settings = processor_settings(path, args.vision.image_size, args.tokens_per_image)
    settings["system_prompt"] = False  # DeepseekVLProcessor has none
    return DeepseekVlVision(encoder, **settings)


def _hf_name(name: str) -> str | None:
    """The encoder's name of a checkpoint tensor; None for every other part's (the
    language model's, the tower's pooling head)."""
    if name.startswith(_TOWER):
        rest = name[len(_TOWER) :].removeprefix("vision_model.")
        return None if rest.startswith("head.") else "vision_model." + rest
    for old, new in _NAMES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return None
