"""HunYuan-VL's (HunyuanOCR's) vision tower and projector (llmrun.models.hunyuan_vl_vision)
from either format: the Hugging Face folder's vit.* tensors (Tencent's names, which
transformers' save_pretrained writes back) and its preprocessor_config.json, or the mmproj
GGUF that llama.cpp's converter writes (conversion/hunyuan.py HunyuanVLVisionModel;
tools/mtmd/clip.cpp reads it): projector type hunyuanvl, the position table without its
class token's row, the projector as mm.pre_norm, mm.0, mm.2, mm.model.fc, mm.post_norm,
mm.image_begin, mm.image_end and v.image_newline. The unused image_sep (the converter's
v.view_seperator) is left out. Both give the tower HF's weights.
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
    prefixed_weights,
    projector_type,
    with_suffixes,
    with_weights,
)
from llmrun.models.hunyuan_vl_vision import EncoderArgs, VisionModel

MODEL_TYPE, TEXT_MODEL_TYPE = "hunyuan_vl", "hunyuan_v1_dense"
# HunYuanVLImageProcessor's defaults (OpenAI CLIP's mean and std; 512² to 2048² pixels).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 512 * 512, 2048 * 2048
_UNUSED = "perceive.image_sep"
_GGUF_NAMES = {
    **with_suffixes(
        {
            "v.patch_embd": "embeddings.patch_embedding",
            "mm.0": "perceive.proj_conv",
            "mm.2": "perceive.proj_out",
            "mm.model.fc": "perceive.mlp",
        }
    ),
    "v.position_embd.weight": "embeddings.position_embedding.weight",
    "mm.pre_norm.weight": "perceive.before_rms.weight",
    "mm.post_norm.weight": "perceive.after_rms.weight",
    "mm.image_begin": "perceive.image_begin",
    "mm.image_end": "perceive.image_end",
    "v.image_newline": "perceive.image_newline",
    "v.view_seperator": _UNUSED,
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}


@dataclass
class HunyuanVision:
    """A loaded HunYuan-VL vision tower and how images are prepared for it
    (HunYuanVLImageProcessor's settings)."""

    encoder: VisionModel
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a HunYuan-VL's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is Hunyuan dense's with XD-RoPE's sections."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE and turns_by_mrope(text_config)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is HunYuan-VL's."""
    return projector_type(path) == VisionProjectorType.HUNYUANVL


def from_hf_dir(path: Path, text_hidden: int) -> HunyuanVision:
    """The vision tower and projector of a HunYuan-VL folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config, text_hidden)
    weights = prefixed_weights(path, {"vit.": "", "model.vision_tower.": ""})
    weights = {
        name.replace("perceive.proj.0.", "perceive.proj_conv.").replace(
            "perceive.proj.2.", "perceive.proj_out."
        ): tensor
        for name, tensor in weights.items()
        if not name.startswith(_UNUSED)
    }
    processor = processor_settings(path, args, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, path, processor)


def from_mmproj(path: str | Path, text_hidden: int) -> HunyuanVision:
    """The vision tower and projector of llama.cpp's mmproj GGUF (projector hunyuanvl)."""
    gg, need = open_mmproj(path, VisionProjectorType.HUNYUANVL)
    meta = gg.metadata
    vision = Keys.ClipVision
    position = gg.tensors.get("v.position_embd.weight")
    width = need(vision.EMBEDDING_LENGTH)
    if position is None or len(position.shape) != 2 or width not in position.shape:
        raise ModelFormatError(f"{gg.path}: no 2-D v.position_embd.weight {width} wide")
    if meta.get(vision.USE_GELU) is False or meta.get(vision.USE_SILU):
        raise ModelFormatError(f"{gg.path}: HunYuan-VL's tower takes GELU, not another")
    rows = position.shape[0] if position.shape[1] == width else position.shape[1]
    args = EncoderArgs(
        hidden_size=width,
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        num_positions=rows + 1,  # the converter drops the class token's row
        patch_size=need(vision.PATCH_SIZE),
        spatial_merge_size=need(vision.SPATIAL_MERGE_SIZE, 2),
        rms_norm_eps=float(need(vision.Attention.LAYERNORM_EPS, 1e-5)),
    )
    weights = mmproj_tensors(gg, _gguf_name, "HunYuan-VL's tower", lambda n: n != _UNUSED)
    table = weights["embeddings.position_embedding.weight"]
    unused_row = torch.zeros(1, table.shape[-1], dtype=table.dtype)
    weights["embeddings.position_embedding.weight"] = torch.cat([unused_row, table])
    processor = pixel_settings(gg, need, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, gg.path, processor)


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, "layers.")


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    processor: dict[str, Any],
) -> HunyuanVision:
    """The tower with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(VisionModel, args, weights, source, (args.out_hidden_size, text_hidden))
    return HunyuanVision(encoder, **processor)
