"""LFM2-VL's image encoder (SigLIP2 NaFlex tower, pixel-unshuffle projector) from either
format: its Hugging Face folder (Lfm2VlForConditionalGeneration, whose
preprocessor_config.json says how images are resized and tiled), or the mmproj GGUF that
llama.cpp's converter writes beside the text model's GGUF (conversion/lfm2.py: projector
type lfm2, the patch embedding as a convolution, the tower cut to vision_feature_layer).
Both give the encoder HF's weights; the language model (LFM2) loads as for text.

An mmproj holds no image processor settings: images are prepared with
Lfm2VlImageProcessor's defaults (64 to 256 tokens an image, 512-pixel tiles), as
llama.cpp's clip.cpp sets them for LFM2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    projector_type,
    three_floats,
    with_suffixes,
    with_weights,
)
from llmrun.models import lfm2_vl_vision, siglip

MODEL_TYPE = "lfm2_vl"
# Lfm2VlImageProcessor's defaults.
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
DEFAULTS: dict[str, Any] = {
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 10,
    "use_thumbnail": True,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "tile_size": 512,
    "max_pixels_tolerance": 2.0,
}
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as preprocessor_config.json numbers it
# Checkpoint key prefixes of the vision parts (the Hub's older layout and transformers
# 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# The GGUF module names (gguf-py's tensor_mapping) -> the encoder's; the layers' are SigLIP's.
_GGUF_MODULES = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "mm.input_norm": "multi_modal_projector.layer_norm",
    "mm.1": "multi_modal_projector.linear_1",
    "mm.2": "multi_modal_projector.linear_2",
}
_GGUF_NAMES = with_suffixes(_GGUF_MODULES)


@dataclass
class Lfm2VlVision:
    """A loaded LFM2-VL image encoder and how images are prepared for it (the fields of
    Lfm2VlImageProcessor): resized to a multiple of patch x downsample_factor pixels a
    side within min_image_tokens..max_image_tokens, or, where splitting and larger than
    max_image_tokens x max_pixels_tolerance, cut into tiles of tile_size pixels
    (min_tiles..max_tiles of them) plus a thumbnail; normalized by mean and std."""

    encoder: lfm2_vl_vision.ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    tile_size: int
    max_pixels_tolerance: float

    @property
    def patch(self) -> int:
        return self.encoder.args.vision.patch_size

    @property
    def factor(self) -> int:
        return self.encoder.args.downsample_factor


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of an LFM2-VL with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of an LFM2-VL."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type lfm2 (read_gguf's checks)."""
    return projector_type(path) == VisionProjectorType.LFM2


def from_hf_dir(path: Path, text_hidden: int) -> Lfm2VlVision:
    """The image encoder of an LFM2-VL Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not an LFM2-VL folder with a vision_config")
    args = lfm2_vl_vision.EncoderArgs.from_config(config)
    layers = args.vision.num_hidden_layers
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            for old, new in _HF_PREFIXES.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
                    if _layer(name) < layers:  # past vision_feature_layer: unused
                        weights[name] = tensor
                    break
    return _build(args, weights, text_hidden, path, **_processor_settings(path, args))


def _layer(name: str) -> int:
    """The tower layer of an encoder weight's name, -1 for the others."""
    parts = name.split(".")
    if parts[:3] == ["vision_tower", "encoder", "layers"] and parts[3].isdigit():
        return int(parts[3])
    return -1


def _processor_settings(path: Path, args: lfm2_vl_vision.EncoderArgs) -> dict[str, Any]:
    """preprocessor_config.json's (or processor_config.json's image_processor) resizing,
    tiling and normalization, else Lfm2VlImageProcessor's defaults; its patch and
    downsample sizes must be the model's."""
    file = path / "preprocessor_config.json"
    nested = not file.is_file() and (path / "processor_config.json").is_file()
    if nested:  # LFM2.5-VL's: the image processor's fields under "image_processor"
        file = path / "processor_config.json"
    processor: dict[str, Any] = {}
    if file.is_file():
        try:
            processor = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
        if nested and isinstance(processor, dict):
            processor = processor.get("image_processor", {})
        if not isinstance(processor, dict):
            raise ModelFormatError(f"{file}: not a JSON object")
    if processor.get("resample", BILINEAR) != BILINEAR:
        raise UnsupportedError(
            f"{file}: resample is {processor['resample']!r}; llmrun resizes LFM2-VL's images "
            f"bilinearly only ({BILINEAR}, the image processor's default)"
        )
    for key, value in (
        ("encoder_patch_size", args.vision.patch_size),
        ("downsample_factor", args.downsample_factor),
    ):
        if processor.get(key, value) != value:
            raise ModelFormatError(
                f"{file}: {key} is {processor[key]!r}, but the model's is {value}"
            )
    settings = {}
    for key, default in DEFAULTS.items():
        value = processor.get(key, default)
        kind = bool if isinstance(default, bool) else int if isinstance(default, int) else float
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and value <= 0):
            raise ModelFormatError(f"{file}: {key} is {value!r}")
        settings[key] = value
    if settings["min_tiles"] > settings["max_tiles"]:
        raise ModelFormatError(f"{file}: min_tiles is more than max_tiles")
    for key in ("image_mean", "image_std"):
        settings[key[6:]] = three_floats(processor.get(key, DEFAULT_MEAN_STD), file, key)
    return settings


def from_mmproj(path: str | Path, text_hidden: int) -> Lfm2VlVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type lfm2)."""
    gg, need = open_mmproj(path, VisionProjectorType.LFM2)
    meta = gg.metadata
    vision = Keys.ClipVision

    layers = need(vision.BLOCK_COUNT)
    # llama.cpp's block count leaves out the layers past it.
    weights = mmproj_tensors(
        gg, _gguf_name, "LFM2-VL's image encoder", keep=lambda name: _layer(name) < layers
    )
    patch = need(vision.PATCH_SIZE)
    embedding = weights.get("vision_tower.embeddings.patch_embedding.weight")
    if embedding is not None and embedding.dim() == 4:
        # The converter's convolution [hidden, 3, p, p] -> the Linear over patches
        # flattened (row, column, channel).
        weights["vision_tower.embeddings.patch_embedding.weight"] = embedding.permute(
            0, 2, 3, 1
        ).reshape(embedding.shape[0], -1)
    positions = weights.get("vision_tower.embeddings.position_embedding.weight")
    # The converter writes image_size 256 whatever the grid: the positions tell it.
    side = math.isqrt(positions.shape[0]) if positions is not None else 0
    if positions is None or side * side != positions.shape[0]:
        raise ModelFormatError(f"{gg.path}: v.position_embd is not a square grid of positions")
    projector = weights.get("multi_modal_projector.linear_1.weight")
    if projector is None:
        raise ModelFormatError(f"{gg.path}: missing vision tensor mm.1.weight")
    args = lfm2_vl_vision.EncoderArgs(
        siglip.VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=layers,
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=side * patch,
            patch_size=patch,
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden_size=need(vision.PROJECTION_DIM, text_hidden),
        projector_hidden_size=projector.shape[0],
        downsample_factor=need(vision.Projector.SCALE_FACTOR, 2),
        projector_bias="multi_modal_projector.linear_1.bias" in weights,
        projector_use_layernorm="multi_modal_projector.layer_norm.weight" in weights,
    )
    mean, std = (
        three_floats(meta.get(key, DEFAULT_MEAN_STD), gg.path, key)
        for key in (vision.IMAGE_MEAN, vision.IMAGE_STD)
    )
    return _build(args, weights, text_hidden, gg.path, mean=mean, std=std, **DEFAULTS)


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, "vision_tower.encoder.layers.")


def _build(
    args: lfm2_vl_vision.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> Lfm2VlVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    unit = args.vision.patch_size * args.downsample_factor
    if settings["tile_size"] % unit:
        raise ModelFormatError(
            f"{source}: tiles of {settings['tile_size']} pixels are not a multiple of {unit} "
            f"(patches of {args.vision.patch_size}, unshuffled by {args.downsample_factor})"
        )
    encoder = with_weights(
        lfm2_vl_vision.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Lfm2VlVision(encoder, **settings)
