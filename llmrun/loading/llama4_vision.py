"""Llama 4's image encoder (llmrun.models.llama4_vision) from either format: the Hugging
Face folder of a Llama4ForConditionalGeneration (vision_model.*, multi_modal_projector.*)
with its preprocessor_config.json (Llama4ImageProcessor's tiles), or the mmproj GGUF that
llama.cpp's converter writes beside the text GGUF (conversion/llama4.py
Llama4VisionModel: projector type llama4, the adapter as mm.model.mlp.1/2, the projector
as mm.model.fc; tools/mtmd/clip.cpp reads it). Both give the encoder HF's weights.

An mmproj holds no tiling settings: llmrun tiles its images with Llama4ImageProcessor's
defaults (up to 16 tiles, never enlarged past one tile a side). clip.cpp reads each
layer's second LayerNorm as ln2; the converter now names it attn_post_norm (gguf-py maps
post_attention_layernorm to Gemma 4's name too, and the later entry wins), which clip.cpp
runs as another norm (on the attention's output), so llmrun refuses such a file rather
than guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    encoder_tensor,
    mmproj_name,
    open_mmproj,
    positive_int,
    prefixed_weights,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models.llama4_vision import EncoderArgs, ImageEncoder, VisionArgs

MODEL_TYPE = "llama4"
TEXT_MODEL_TYPE = "llama4_text"
# Llama4ImageProcessor's defaults.
MEAN_STD = (0.5, 0.5, 0.5)
MAX_TILES = 16
RESCALE = 1 / 255
BILINEAR = 2  # PILImageResampling.BILINEAR, the only filter Llama 4's processor uses
_HF_PREFIXES = {
    "model.vision_model.": "vision_model.",
    "vision_model.": "vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
_TOWER = "vision_model."
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_GGUF_NAMES = {
    "v.patch_embd.weight": _TOWER + "patch_embedding.linear.weight",
    "v.class_embd": _TOWER + "class_embedding",
    "v.position_embd.weight": _TOWER + "positional_embedding_vlm",
    "v.pre_ln.weight": _TOWER + "layernorm_pre.weight",
    "v.pre_ln.bias": _TOWER + "layernorm_pre.bias",
    "v.post_ln.weight": _TOWER + "layernorm_post.weight",
    "v.post_ln.bias": _TOWER + "layernorm_post.bias",
    "mm.model.mlp.1.weight": _TOWER + "vision_adapter.mlp.fc1.weight",
    "mm.model.mlp.2.weight": _TOWER + "vision_adapter.mlp.fc2.weight",
    "mm.model.fc.weight": "multi_modal_projector.linear_1.weight",
}


@dataclass
class Llama4Vision:
    """A loaded Llama 4 image encoder and how images are tiled for it: onto a grid of at
    most max_tiles squares of `tile` pixels (and the whole image in one more), scaled by
    rescale_factor and normalized by mean and std."""

    encoder: ImageEncoder
    tile: int
    max_tiles: int
    resize_to_max_canvas: bool
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def tokens_per_tile(self) -> int:
        return self.encoder.args.vision.tokens_per_tile


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Llama4ForConditionalGeneration's with its
    vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Llama 4's (a folder's text_config, or a GGUF's)."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Llama 4's."""
    return projector_type(path) == VisionProjectorType.LLAMA4


def from_hf_dir(path: Path, text_hidden: int) -> Llama4Vision:
    """Llama 4's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    vision, text = config.get("vision_config"), config.get("text_config")
    if config.get("model_type") != MODEL_TYPE or not isinstance(vision, dict):
        raise UsageError(f"{path}: not a Llama 4 folder with a vision_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{path}: a Llama 4 config without text_config")
    layer = vision.get("vision_feature_layer", -1)
    strategy = vision.get("vision_feature_select_strategy", "default")
    if layer != -1 or strategy != "default":
        raise UnsupportedError(
            f"{path}: Llama 4 image features from vision_feature_layer {layer!r} with strategy "
            f"{strategy!r}; llmrun takes the last layer's (-1, 'default'), as transformers does"
        )
    width = text.get("hidden_size")
    if not positive_int(width):
        raise ModelFormatError(f"{path}: text_config's hidden_size is {width!r}")
    args = EncoderArgs(VisionArgs.from_config(vision), width)
    weights = prefixed_weights(path, _HF_PREFIXES)
    return _build(args, weights, text_hidden, path, **_processor_settings(path))


def _processor_settings(path: Path) -> dict[str, Any]:
    """preprocessor_config.json's tile size, max_patches, resize_to_max_canvas,
    rescale_factor, image_mean and image_std; Llama4ImageProcessor's defaults where it has
    none (336-pixel tiles)."""
    file = path / "preprocessor_config.json"
    processor: dict[str, Any] = {}
    if file.is_file():
        try:
            processor = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    size = processor.get("size", {"height": 336, "width": 336})
    tile = size.get("height") if isinstance(size, dict) else None
    if not positive_int(tile) or size.get("width") != tile:
        raise ModelFormatError(f"{file}: size is {size!r}, not a square tile in pixels")
    max_tiles = processor.get("max_patches", MAX_TILES)
    if not positive_int(max_tiles):
        raise ModelFormatError(f"{file}: max_patches is {max_tiles!r}")
    resample = processor.get("resample", BILINEAR)
    if resample != BILINEAR:
        raise UnsupportedError(f"{file}: resample {resample!r}; llmrun resizes bilinearly (2)")
    rescale = processor.get("rescale_factor", RESCALE)
    if not isinstance(rescale, float) or not 0 < rescale <= 1:
        raise ModelFormatError(f"{file}: rescale_factor is {rescale!r}")
    return dict(
        tile=tile,
        max_tiles=max_tiles,
        resize_to_max_canvas=bool(processor.get("resize_to_max_canvas", False)),
        rescale_factor=rescale,
        mean=three_floats(processor.get("image_mean", MEAN_STD), file, "image_mean"),
        std=three_floats(processor.get("image_std", MEAN_STD), file, "image_std"),
    )


def from_mmproj(path: str | Path, text_hidden: int) -> Llama4Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type llama4)."""
    gg, need = open_mmproj(path, VisionProjectorType.LLAMA4)
    meta = gg.metadata
    vision = Keys.ClipVision

    adapter = gg.tensors.get("mm.model.mlp.1.weight")
    if adapter is None or len(adapter.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D mm.model.mlp.1.weight (the adapter's fc1)")
    width = adapter.shape[0]  # [out, in]
    merge = need(vision.Projector.SCALE_FACTOR, 2)
    args = EncoderArgs(
        VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=need(vision.BLOCK_COUNT),
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            pixel_shuffle_ratio=1 / merge,
            projector_input_dim=width,
            projector_output_dim=width,
            vision_output_dim=width,
            norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden_size=need(vision.PROJECTION_DIM),
    )
    weights = {}
    for info in gg.tensors.values():
        name = _gguf_name(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of Llama 4's encoder"
                + (
                    " (each layer's second LayerNorm is ln2, as clip.cpp reads it)"
                    if ".attn_post_norm." in info.name
                    else ""
                )
            )
        weights[name] = encoder_tensor(gg, info)
    return _build(
        args,
        weights,
        text_hidden,
        gg.path,
        tile=args.vision.image_size,
        max_tiles=MAX_TILES,
        resize_to_max_canvas=False,
        rescale_factor=RESCALE,
        mean=three_floats(meta.get(vision.IMAGE_MEAN, MEAN_STD), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, MEAN_STD), gg.path, vision.IMAGE_STD),
    )


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, _TOWER + "model.layers.")


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> Llama4Vision:
    """The encoder with `weights` (checked against its shapes), in f32; its tiles must be
    the tower's image size (its position table and RoPE are of that grid)."""
    if settings["tile"] != args.vision.image_size:
        raise ModelFormatError(
            f"{source}: tiles of {settings['tile']} pixels, but the vision tower takes "
            f"{args.vision.image_size}"
        )
    encoder = with_weights(
        ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Llama4Vision(encoder, **settings)
