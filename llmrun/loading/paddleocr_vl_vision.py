"""PaddleOCR-VL's vision tower and projector (llmrun.models.paddleocr_vl_vision) from either
format: the Hugging Face folder's visual.vision_model.* and mlp_AR.* tensors (model.visual.*
and model.projector.* as transformers 5 names them in memory) and its
preprocessor_config.json, or the mmproj GGUF that llama.cpp's converter writes
(conversion/ernie.py PaddleOCRVisionModel; tools/mtmd/clip.cpp reads it): projector type
paddleocr, SigLIP's tensor names, the projector as mm.input_norm, mm.1 and mm.2. The
tower's unused parts (the pooling head, packing_position_embedding) are left out, as
transformers and the converter leave them. Both give the tower HF's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import processor_settings, turns_by_mrope
from llmrun.loading.vision import (
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    pixel_settings,
    projector_type,
    with_suffixes,
    with_weights,
)
from llmrun.models.paddleocr_vl_vision import EncoderArgs, VisionModel

MODEL_TYPE, TEXT_MODEL_TYPE = "paddleocr_vl", "paddleocr_vl_text"
# PaddleOCRVLImageProcessor's defaults (OpenAI CLIP's mean and std; 384² to 1536² pixels).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 384 * 384, 1536 * 1536
TEXT_HIDDEN = 1024  # PaddleOCRTextConfig's default
_HF_PREFIXES = {
    "model.visual.vision_model.": "",
    "visual.vision_model.": "",
    "model.projector.": "projector.",
    "mlp_AR.": "projector.",
}
_UNUSED = ("head.", "embeddings.packing_position_embedding.")
_GGUF_NAMES = {
    **with_suffixes(
        {
            "v.patch_embd": "embeddings.patch_embedding",
            "v.post_ln": "post_layernorm",
            "mm.input_norm": "projector.pre_norm",
            "mm.1": "projector.linear_1",
            "mm.2": "projector.linear_2",
        }
    ),
    "v.position_embd.weight": "embeddings.position_embedding.weight",
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


@dataclass
class PaddleOCRVision:
    """A loaded PaddleOCR-VL vision tower and how images are prepared for it
    (PaddleOCRVLImageProcessor's settings)."""

    encoder: VisionModel
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a PaddleOCR-VL's with its
    vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is PaddleOCR-VL's, with its M-RoPE sections."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE and turns_by_mrope(text_config)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is PaddleOCR-VL's."""
    return projector_type(path) == VisionProjectorType.PADDLEOCR


def from_hf_dir(path: Path, text_hidden: int) -> PaddleOCRVision:
    """The vision tower and projector of a PaddleOCR-VL folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    args = EncoderArgs.from_config(config, text.get("hidden_size", TEXT_HIDDEN))
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            prefix = next((p for p in _HF_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            new = _HF_PREFIXES[prefix] + name[len(prefix) :]
            if not new.startswith(_UNUSED):
                weights[new] = tensor
    processor = processor_settings(path, args, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, path, processor)


def from_mmproj(path: str | Path, text_hidden: int) -> PaddleOCRVision:
    """The vision tower and projector of llama.cpp's mmproj GGUF (projector paddleocr)."""
    gg, need = open_mmproj(path, VisionProjectorType.PADDLEOCR)
    meta = gg.metadata
    vision = Keys.ClipVision
    position = gg.tensors.get("v.position_embd.weight")
    if position is None or len(position.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D v.position_embd.weight")
    if meta.get(vision.USE_GELU) is False or meta.get(vision.USE_SILU):
        raise ModelFormatError(f"{gg.path}: PaddleOCR-VL's tower takes GELU, not another")
    width = need(vision.EMBEDDING_LENGTH)
    args = EncoderArgs(
        hidden_size=width,
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        num_positions=next((d for d in position.shape if d != width), width),
        patch_size=need(vision.PATCH_SIZE),
        layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS, 1e-6)),
    )
    weights = mmproj_tensors(gg, _gguf_name, "PaddleOCR-VL's tower")
    processor = pixel_settings(gg, need, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, gg.path, processor)


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, "encoder.layers.")


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    processor: dict[str, Any],
) -> PaddleOCRVision:
    """The tower with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(VisionModel, args, weights, source, (args.out_hidden_size, text_hidden))
    return PaddleOCRVision(encoder, **processor)
