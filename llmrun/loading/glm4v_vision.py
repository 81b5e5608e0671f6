"""GLM-4.1V's, GLM-4.5V's, GLM-4.6V's and GLM-OCR's vision tower (llmrun.models.glm4v_vision) from
either format: the Hugging Face folder's model.visual.* tensors and its
preprocessor_config.json, or the mmproj GGUF that llama.cpp's converter writes
(conversion/qwen3vl.py Glm4VVisionModel; tools/mtmd/models/glm4v.cpp reads it): projector
type glm4v, the Conv3d patch weight split into its two frames (v.patch_embd.weight and
.weight.1), the downsample Conv2d as mm.patch_merger, the merger as mm.model.fc,
mm.post_norm, mm.gate, mm.up and mm.down.
GLM-OCR's mmproj has the same projector type, no v.norm_embd nor v.position_embd, and
per-head v.blk.N.attn_q_norm / attn_k_norm. Both give the encoder HF's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import (
    open_vision_mmproj,
    processor_settings,
    tower_weights,
    visual_tensors,
)
from llmrun.loading.vision import (
    encoder_tensor,
    pixel_settings,
    projector_type,
    with_weights,
)
from llmrun.models.glm4v_vision import EncoderArgs, VisionModel

# GLM-4.6V as transformers 5 saves it (glm46v) has GLM-4.1V's tower (glm4v_vision).
MODEL_TYPES = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
# Glm4vImageProcessor's defaults (OpenAI CLIP's mean and std; its pixel limits count the
# two frames of a still image), what a folder without its own settings or an mmproj gets.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 112 * 112, 28 * 28 * 15000
# clip.cpp's names -> the tower's.
_GGUF_LAYER = {
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_NAMES = {
    "v.patch_embd": "patch_embed.proj",
    "v.norm_embd": "post_conv_layernorm",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
    "mm.patch_merger": "downsample",
    "mm.model.fc": "merger.proj",
    "mm.post_norm": "merger.post_projection_norm",
    "mm.gate": "merger.gate_proj",
    "mm.up": "merger.up_proj",
    "mm.down": "merger.down_proj",
}


@dataclass
class Glm4vVision:
    """A loaded GLM-4.1V, GLM-4.5V or GLM-OCR vision tower and how images are prepared
    for it (Glm4vImageProcessor's settings, as llmrun.glm4v_images reads them)."""

    encoder: VisionModel
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a GLM-4.1V's, GLM-4.5V's, GLM-4.6V's
    or GLM-OCR's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


# llmrun's families of their language models, which take images where they turn by M-RoPE.
TEXT_MODEL_TYPES = ("glm4", "glm4_moe")


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is GLM-4.xV's: GLM-4's or GLM-4.5's with M-RoPE
    sections."""
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    return text_config.get("model_type") in TEXT_MODEL_TYPES and bool(rope.get("mrope_section"))


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is GLM-4V's."""
    return projector_type(path) == VisionProjectorType.GLM4V


def from_hf_dir(path: Path, text_hidden: int) -> Glm4vVision:
    """The vision tower of a GLM-4.1V, GLM-4.5V or GLM-OCR folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config)
    weights = visual_tensors(path)
    processor = processor_settings(path, args, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, path, processor)


def from_mmproj(path: str | Path, text_hidden: int) -> Glm4vVision:
    """The vision tower of llama.cpp's mmproj GGUF (projector glm4v; GLM-OCR's where it
    has no learned positions)."""
    gg, _, need = open_vision_mmproj(path, (VisionProjectorType.GLM4V,), "GLM-4V")
    meta = gg.metadata
    vision = Keys.ClipVision
    if meta.get(vision.USE_SILU, False):
        act = "silu"
    elif meta.get(vision.USE_GELU, False):
        act = "gelu"
    else:
        raise UnsupportedError(f"{gg.path}: names neither {vision.USE_SILU} nor {vision.USE_GELU}")
    positions = gg.tensors.get("v.position_embd.weight")
    glm_ocr = positions is None
    if glm_ocr and "v.blk.0.attn_q_norm.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: neither v.position_embd.weight (GLM-4.xV) nor "
            "v.blk.0.attn_q_norm.weight (GLM-OCR)"
        )
    eps = meta.get(vision.Attention.LAYERNORM_EPS, 1e-5)
    if not isinstance(eps, float) or not 0 < eps < 1:
        raise ModelFormatError(f"{gg.path}: metadata {vision.Attention.LAYERNORM_EPS!r} is {eps!r}")
    args = EncoderArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        depth=need(vision.BLOCK_COUNT),
        num_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        num_position_embeddings=0 if glm_ocr else positions.shape[0],
        hidden_act=act,
        attention_bias="v.blk.0.attn_qkv.bias" in gg.tensors,
        rms_norm_eps=eps,
        patch_size=need(vision.PATCH_SIZE),
        spatial_merge_size=need(vision.SPATIAL_MERGE_SIZE, 2),
        glm_ocr=glm_ocr,
    )
    tensors = {}
    for info in gg.tensors.values():
        tensor = encoder_tensor(gg, info)
        tensors[info.name] = tensor.float()
    weights = tower_weights(tensors, _GGUF_NAMES, _GGUF_LAYER, gg.path)
    processor = pixel_settings(gg, need, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, gg.path, processor)


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    processor: dict[str, Any],
) -> Glm4vVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(VisionModel, args, weights, source, (args.out_hidden_size, text_hidden))
    return Glm4vVision(encoder, **processor)
