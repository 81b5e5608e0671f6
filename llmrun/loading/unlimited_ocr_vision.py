"""Unlimited-OCR's image encoder from either format: its Hugging Face folder
(UnlimitedOcrForConditionalGeneration, model_type unlimited_ocr; the checkpoint's keys are
DeepSeek-OCR's own, as transformers saves them: model.sam_model.*, model.vision_model.*
with each layer's q, k and v in one qkv_proj, model.projector.*, model.image_newline,
model.view_seperator), or the mmproj GGUF that llama.cpp's converter writes beside the text
model's GGUF (conversion/deepseek.py UnlimitedOCRVisionModel: projector type deepseekocr,
DeepSeek-OCR's, with up to 32 crops). Both give the encoder HF's weights. Images are
prepared as the folder's image processor says: the whole image resized into `size` and
padded to a square, and where it is larger than a crop, crops of a grid of tiles.

An mmproj is read as llama.cpp's clip.cpp reads it, with the values it fixes rather than
reads: 16-pixel patches, a 1024-pixel whole view and 640-pixel crops, SAM's global
attention in layers 2, 5, 8 and 11 and its LayerNorms at 1e-6, CLIP's at 1e-5 (the file
says 1e-6); CLIP's MLP width is its tensors' (the converter writes 4 x heads as
feed_forward_length). Images are prepared as transformers does for either format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.deepseek_ocr2_vision import _gguf_name as _sam_gguf_name
from llmrun.loading.deepseek_ocr2_vision import (
    crop_settings,
    mmproj_crops,
    mmproj_sam,
    sam_args,
    sub_config,
    tensor_rows,
)
from llmrun.loading.vision import (
    image_processor,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    prefixed_weights,
    projector_type,
    with_weights,
)
from llmrun.models import unlimited_ocr_vision as model
from llmrun.models.llava_vision import VisionArgs

MODEL_TYPE = "unlimited_ocr"
# DeepSeek-OCR's projector, which Unlimited-OCR's mmproj shares (gguf's
# VisionProjectorType.DEEPSEEKOCR).
PROJECTOR = "deepseekocr"
# What clip.cpp fixes for this projector's CLIP body (hparams.eps); SAM's are DeepSeek-OCR
# 2's (llmrun.loading.deepseek_ocr2_vision.mmproj_sam).
_GGUF_CLIP_EPS = 1e-5
_HF_PREFIXES = {
    "model.sam_model.": "sam_model.",
    "model.vision_model.": "vision_model.",
    "model.projector.": "projector.",
    "model.image_newline": "image_newline",
    "model.view_seperator": "view_seperator",
}
# DeepSeek-OCR's CLIP keeps a patch embedding that it never runs (SAM's features are its
# patches); transformers drops it.
_UNUSED = "vision_model.embeddings.patch_embedding."
# UnlimitedOcrImageProcessor's defaults.
_MEAN_STD = (0.5, 0.5, 0.5)
_SIZE, _TILE, _MIN_CROPS, _MAX_CROPS = 1024, 640, 2, 32
_BACKGROUND = (127, 127, 127)
# UnlimitedOcrProcessor's defaults: the patch size and the SAM grid's downsampling by its
# two stride-2 convolutions, by which it counts a view's tokens.
_PATCH, _DOWNSAMPLE = 16, 4
# UnlimitedOcrSamVisionConfig's and UnlimitedOcrVisionEncoderConfig's defaults where they
# differ from llmrun's SamArgs and VisionArgs.
_SAM_DEFAULTS = {"downsample_channels": [512, 1024]}
_CLIP_DEFAULTS = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
}


@dataclass
class UnlimitedOcrVision:
    """A loaded Unlimited-OCR image encoder and how images are prepared for it: the whole
    image into `size` pixels, padded with `background`; crops of `tile` pixels, from
    `min_crops` to `max_crops` of them, where its longer side is over `tile`; a view's
    grid is `global_side` (the whole image's) or `crop_side` tokens square."""

    encoder: model.ImageEncoder
    size: int
    tile: int
    min_crops: int
    max_crops: int
    background: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    global_side: int
    crop_side: int


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of an Unlimited-OCR with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of an Unlimited-OCR with its vision tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def _text_hidden(config: dict[str, Any], path: Path) -> int:
    text = config.get("text_config", config.get("language_config"))
    width = text.get("hidden_size", 1280) if isinstance(text, dict) else None
    if not positive_int(width):
        raise ModelFormatError(f"{path}: an Unlimited-OCR config without its text model's width")
    return width


def encoder_args(config: dict[str, Any], path: Path) -> model.EncoderArgs:
    """The encoder's shape from an Unlimited-OCR config.json (its sub-configs' defaults
    where it has none, as transformers reads DeepSeek's own files)."""
    vision = config["vision_config"]
    sam = sam_args({**_SAM_DEFAULTS, **sub_config(vision, "sam_config", path)}, path)
    sam.global_attn_indexes = list(sam.global_attn_indexes)
    sam.downsample_channels = list(sam.downsample_channels)
    clip_config = {**_CLIP_DEFAULTS, **sub_config(vision, "encoder_config", path)}
    clip = VisionArgs.from_config(clip_config)
    if len(sam.downsample_channels) != 2 or sam.downsample_channels[-1] != clip.hidden_size:
        raise ModelFormatError(
            f"{path}: SAM gives {sam.downsample_channels} features, its CLIP takes "
            f"{clip.hidden_size}"
        )
    return model.EncoderArgs(sam, clip, _text_hidden(config, path))


def _view_side(args: model.EncoderArgs, side: int, patch: int, source: Path) -> int:
    """The grid side of a view `side` pixels square: SAM's after its two stride-2
    convolutions, which must be what UnlimitedOcrProcessor counts (the side in patches
    over the downsampling, rounded up)."""
    grid = -(-side // args.sam.patch_size)
    for _ in range(2):
        grid = -(-grid // 2)
    counted = math.ceil(side // patch / _DOWNSAMPLE)
    if side % args.sam.patch_size or grid != counted:
        raise ModelFormatError(
            f"{source}: a view of {side} pixels gives a grid of {grid} tokens a side, but "
            f"the processor counts {counted}"
        )
    return grid


def _split_qkv(weights: dict[str, torch.Tensor], fused: str) -> dict[str, torch.Tensor]:
    """Each CLIP layer's fused `fused` (qkv_proj) weight and bias as q_proj, k_proj and
    v_proj (thirds of the rows, as transformers' conversion chunks them)."""
    out = {}
    for name, tensor in weights.items():
        module, _, suffix = name.rpartition(".")
        if module.endswith(fused):
            if tensor.shape[0] % 3:
                raise ModelFormatError(f"{name} has {tensor.shape[0]} rows, not three thirds")
            base = module[: -len(fused)]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3), strict=True):
                out[f"{base}{part}.{suffix}"] = rows
        else:
            out[name] = tensor
    return out


def from_hf_dir(path: Path, text_hidden: int) -> UnlimitedOcrVision:
    """Unlimited-OCR's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not an Unlimited-OCR folder with a vision_config")
    args = encoder_args(config, path)
    source, settings = image_processor(path)
    crops = crop_settings(source, settings, _SIZE, _TILE, _MIN_CROPS, _MAX_CROPS)
    patch = _processor_patch(path)
    weights = prefixed_weights(path, _HF_PREFIXES)
    weights = {k: v for k, v in weights.items() if not k.startswith(_UNUSED)}
    encoder = with_weights(
        model.ImageEncoder,
        args,
        _split_qkv(weights, "qkv_proj"),
        path,
        (args.text_hidden_size, text_hidden),
    )
    return UnlimitedOcrVision(
        encoder,
        crops.size,
        crops.tile,
        crops.min_crops,
        crops.max_crops,
        crops.background,
        crops.mean,
        crops.std,
        _view_side(args, crops.size, patch, source),
        _view_side(args, crops.tile, patch, source),
    )


def _processor_patch(path: Path) -> int:
    """processor_config.json's patch_size (by which the processor counts tokens), else its
    default 16."""
    file = path / "processor_config.json"
    patch = safetensors_io.read_json(file).get("patch_size", _PATCH) if file.is_file() else _PATCH
    if not positive_int(patch):
        raise ModelFormatError(f"{file}: patch_size is {patch!r}")
    return patch


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type deepseekocr (read_gguf's checks)."""
    return projector_type(path) == PROJECTOR


# mmproj names -> the encoder's (conversion/deepseek.py through gguf-py's tensor_mapping).
_GGUF_NAMES = {
    "v.class_embd": "vision_model.embeddings.class_embedding",
    "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
    "v.patch_embd.weight": f"{_UNUSED}weight",
    "v.pre_ln.weight": "vision_model.pre_layrnorm.weight",
    "v.pre_ln.bias": "vision_model.pre_layrnorm.bias",
    "v.image_newline": "image_newline",
}
_CLIP_LAYER = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if parts[:2] == ["v", "blk"] and len(parts) == 5 and parts[2].isdigit():
        layer = _CLIP_LAYER.get(parts[3])
        if layer is not None and parts[4] in ("weight", "bias"):
            return f"vision_model.transformer.layers.{parts[2]}.{layer}.{parts[4]}"
        return None
    # SAM's, the projector and the view separator are named as DeepSeek-OCR 2's.
    return _sam_gguf_name(name)


def from_mmproj(path: str | Path, text_hidden: int) -> UnlimitedOcrVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type deepseekocr)."""
    gg, need = open_mmproj(path, PROJECTOR)
    vision = Keys.ClipVision
    weights = mmproj_tensors(
        gg, _gguf_name, "Unlimited-OCR's encoder", keep=lambda name: not name.startswith(_UNUSED)
    )
    weights = _split_qkv(weights, "qkv_proj")
    for name in ("view_seperator", "image_newline"):  # [1, hidden] in the file
        if name in weights:
            weights[name] = weights[name].flatten()
    shapes = {name: tuple(w.shape) for name, w in weights.items()}
    sam = mmproj_sam(gg, need, shapes, _SIZE)
    positions = tensor_rows(shapes, "vision_model.embeddings.position_embedding.weight", gg.path)
    side = math.isqrt(positions - 1)
    if side * side + 1 != positions:
        raise ModelFormatError(
            f"{gg.path}: {positions} CLIP positions are not a square grid and a class token"
        )
    clip = VisionArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=tensor_rows(
            shapes, "vision_model.transformer.layers.0.mlp.fc1.weight", gg.path
        ),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        image_size=side,
        patch_size=1,  # the table's grid, whatever the file's image and patch sizes say
        layer_norm_eps=_GGUF_CLIP_EPS,
    )
    args = model.EncoderArgs(sam, clip, need(vision.PROJECTION_DIM))
    min_crops, max_crops, mean, std = mmproj_crops(gg, _MIN_CROPS, _MAX_CROPS, _MEAN_STD)
    encoder = with_weights(
        model.ImageEncoder, args, weights, gg.path, (args.text_hidden_size, text_hidden)
    )
    return UnlimitedOcrVision(
        encoder,
        _SIZE,
        _TILE,
        min_crops,
        max_crops,
        _BACKGROUND,
        mean,
        std,
        _view_side(args, _SIZE, _PATCH, gg.path),
        _view_side(args, _TILE, _PATCH, gg.path),
    )
