"""DeepSeek-VL 7B's image encoder (llmrun.models.deepseek_vl_hybrid_vision) from the Hugging
Face folder of a DeepseekVLHybridForConditionalGeneration: its SigLIP tower
(model.vision_model.*, the pooling head never read), SAM tower (model.high_res_vision_model.*),
second neck, projection, alpha and aligner, and DeepseekVLHybridImageProcessor's settings
for both sizes. Folders only: llama.cpp has no converter for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.deepseek_vl_vision import siglip_args
from llmrun.loading.janus_vision import BICUBIC, CLIP_MEAN, CLIP_STD, processor_settings
from llmrun.loading.vision import image_processor, three_floats, with_weights
from llmrun.models.deepseek_ocr2_vision import SamArgs
from llmrun.models.deepseek_vl_hybrid_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "deepseek_vl_hybrid"
_SIGLIP = "model.vision_model."
# The SAM layers' LayerNorms under the block's names (llmrun.models.deepseek_ocr2_vision).
_SAM_NORM = re.compile(r"(\.vision_encoder\.layers\.\d+\.)layer_norm(\d)\.")
_SAM_FIELDS = (
    "hidden_size",
    "output_channels",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
    "layer_norm_eps",
    "mlp_dim",
    "window_size",
    "global_attn_indexes",
)


@dataclass
class DeepseekVlHybridVision:
    """A loaded DeepSeek-VL hybrid image encoder and how images are prepared for it: the
    high-resolution image as JanusImageProcessor prepares one (its own mean, std and
    filter), and the low-resolution one resized from that padded square."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_size: int
    resample: int
    high_mean: tuple[float, ...]
    high_std: tuple[float, ...]
    high_resample: int

    @property
    def image_size(self) -> int:
        return self.encoder.args.low.image_size

    @property
    def high_size(self) -> int:
        return self.encoder.args.high.image_size

    @property
    def background(self) -> tuple[int, ...]:
        return tuple(int(m * 255) for m in self.mean)

    @property
    def high_background(self) -> tuple[int, ...]:
        return tuple(int(m * 255) for m in self.high_mean)


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a DeepSeek-VL hybrid with both vision configs."""
    config = safetensors_io.read_config(path)
    return (
        config.get("model_type") == MODEL_TYPE
        and isinstance(config.get("vision_config"), dict)
        and isinstance(config.get("high_res_vision_config"), dict)
    )


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no DeepSeek-VL mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> DeepseekVlHybridVision:
    """Refused: there is no DeepSeek-VL hybrid mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no DeepSeek-VL projector; give its folder")


def encoder_args(config: dict[str, Any], text_hidden: int) -> EncoderArgs:
    """The encoder's shape from a DeepseekVLHybridConfig dict (SamVisionConfig's defaults
    where its high_res_vision_config leaves fields out); refuses a SAM tower llmrun's does
    not compute."""
    high = config.get("high_res_vision_config")
    if not isinstance(high, dict):
        raise ModelFormatError("a DeepSeek-VL hybrid config without a high_res_vision_config")
    for key, want in (("use_abs_pos", True), ("use_rel_pos", True), ("qkv_bias", True)):
        if high.get(key, want) is not want:
            raise UnsupportedError(f"a DeepSeek-VL hybrid SAM tower with {key} {high[key]!r}")
    if high.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedError(f"a DeepSeek-VL hybrid SAM tower with {high['hidden_act']!r}")
    sam = SamArgs(**{k: high[k] for k in _SAM_FIELDS if high.get(k) is not None})
    return EncoderArgs(siglip_args(config), sam, text_hidden)


def from_hf_dir(path: Path, text_hidden: int) -> DeepseekVlHybridVision:
    """DeepSeek-VL hybrid's image encoder from its Hugging Face folder (f32, on the CPU)."""
    if not folder_has_vision(path):
        raise ModelFormatError(f"{path}: not a DeepSeek-VL hybrid folder with its vision configs")
    args = encoder_args(safetensors_io.read_config(path), text_hidden)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name)
            if new is not None:
                weights[new] = tensor
    encoder = with_weights(ImageEncoder, args, weights, path, (text_hidden, text_hidden))
    low = processor_settings(path, args.low.image_size, args.tokens_per_image)
    del low["system_prompt"]  # DeepseekVLHybridProcessor has none
    return DeepseekVlHybridVision(encoder, **low, **_high_res_settings(path, args))


def _high_res_settings(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """DeepseekVLHybridImageProcessor's high-resolution settings, refused where its size is
    not the SAM tower's."""
    file, settings = image_processor(path)
    size = settings.get("high_res_size", {"height": 1024, "width": 1024})
    side = args.high.image_size
    if size != {"height": side, "width": side}:
        raise UnsupportedError(
            f"{file}: high-resolution images of size {size!r}; the SAM tower takes {side}x{side}"
        )
    resample = settings.get("high_res_resample", BICUBIC)
    if resample not in range(6):
        raise ModelFormatError(f"{file}: high_res_resample is {resample!r}, not a Pillow filter")
    mean = settings.get("high_res_image_mean", CLIP_MEAN)
    std = settings.get("high_res_image_std", CLIP_STD)
    return dict(
        high_mean=three_floats(mean, file, "high_res_image_mean"),
        high_std=three_floats(std, file, "high_res_image_std"),
        high_resample=resample,
    )


def _hf_name(name: str) -> str | None:
    """The encoder's name of a checkpoint tensor; None for every other part's (the
    language model's, the SigLIP tower's pooling head)."""
    if name.startswith(_SIGLIP):
        rest = name[len(_SIGLIP) :].removeprefix("vision_model.")
        return None if rest.startswith("head.") else "vision_model.vision_model." + rest
    if not name.startswith(("model.high_res_vision_", "model.aligner.")):
        return None
    return _SAM_NORM.sub(r"\1norm\2.", name[len("model.") :])
