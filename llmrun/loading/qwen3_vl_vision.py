"""Qwen3-VL's and Qwen3.5's vision tower (llmrun.models.qwen3_vl_vision) from either
format: the Hugging Face folder's model.visual.* tensors and its preprocessor_config.json,
or the mmproj GGUF that llama.cpp's converter writes (conversion/qwen3vl.py
Qwen3VLVisionModel; tools/mtmd/clip.cpp reads it): projector type qwen3vl_merger, the
Conv3d patch weight split into its two frames (v.patch_embd.weight and .weight.1), the
merger as v.post_ln, mm.0 and mm.2, each deepstack merger as v.deepstack.BLOCK.* named by
the block it follows, which clip.vision.is_deepstack_layers marks. Both give the encoder
HF's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.qwen2_vl_vision import (
    open_vision_mmproj,
    processor_settings,
    tower_weights,
    visual_tensors,
)
from llmrun.loading.vision import (
    encoder_tensor,
    pixel_settings,
    with_weights,
)
from llmrun.models.qwen3_vl_vision import EncoderArgs, VisionModel

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# The Hub's preprocessor_config.json of Qwen3-VL (and Qwen3.5): mean and std 0.5, and
# 65536 to 16777216 pixels; what a folder without one, or an mmproj, gets.
MEAN = STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 65536, 16777216
# clip.cpp's names -> the tower's.
_GGUF_LAYER = {
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1",
    "ffn_down": "mlp.linear_fc2",
}
_GGUF_NAMES = {
    "v.post_ln": "merger.norm",
    "mm.0": "merger.linear_fc1",
    "mm.2": "merger.linear_fc2",
    "v.position_embd": "pos_embed",
    "v.patch_embd": "patch_embed.proj",
}
_GGUF_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


@dataclass
class Qwen3Vision:
    """A loaded Qwen3-VL or Qwen3.5 vision tower and how images are prepared for it
    (Qwen2VLImageProcessor's settings, as llmrun.qwen2_vl_images reads them)."""

    encoder: VisionModel
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a Qwen3-VL's or Qwen3.5's with its
    vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


# llmrun's families of their language models, which take images where they turn by M-RoPE.
TEXT_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen3-VL's: Qwen3's with M-RoPE sections."""
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    return text_config.get("model_type") in TEXT_MODEL_TYPES and bool(rope.get("mrope_section"))


def check_deepstack(vision: Qwen3Vision, text_config: dict[str, Any], source: Path) -> None:
    """Refuses a tower whose deepstack features are not as many as the language model adds
    (a text GGUF's n_deepstack_layers, where it says), as llama.cpp does by width."""
    layers = text_config.get("n_deepstack_layers")
    count = len(vision.encoder.args.deepstack_visual_indexes)
    if layers is not None and layers != count:
        raise UsageError(
            f"{source}: the language model adds {layers} deepstack features to each image "
            f"token, but the mmproj's tower gives {count}: they are not one model's"
        )


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Qwen3-VL's."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return _projector(meta) == VisionProjectorType.QWEN3VL


def _projector(meta: dict[str, Any]) -> Any:
    return meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))


def from_hf_dir(path: Path, text_hidden: int) -> Qwen3Vision:
    """The vision tower of a Qwen3-VL or Qwen3.5 folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config)
    weights = visual_tensors(path)
    processor = processor_settings(path, args, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, path, processor)


def from_mmproj(path: str | Path, text_hidden: int, skip: tuple[str, ...] = ()) -> Qwen3Vision:
    """The vision tower of llama.cpp's mmproj GGUF (projector qwen3vl_merger), the tensors
    whose names begin with one of `skip` left out (another encoder's: Qwen3-Omni's audio)."""
    gg, _, need = open_vision_mmproj(path, (VisionProjectorType.QWEN3VL,), "Qwen3-VL")
    meta = gg.metadata
    vision = Keys.ClipVision
    depth = need(vision.BLOCK_COUNT)
    marks = meta.get(vision.IS_DEEPSTACK_LAYERS, [])
    if not isinstance(marks, list) or len(marks) not in (0, depth):
        raise ModelFormatError(
            f"{gg.path}: {vision.IS_DEEPSTACK_LAYERS} is {marks!r}, not one flag per block"
        )
    positions = gg.tensors.get("v.position_embd.weight")
    if positions is None:
        raise ModelFormatError(f"{gg.path}: no v.position_embd.weight")
    # clip.cpp's FFN: ggml_gelu is the tanh approximation; silu where the file says so.
    act = "silu" if meta.get(vision.USE_SILU, False) else "gelu_pytorch_tanh"
    args = EncoderArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        depth=depth,
        num_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        num_position_embeddings=positions.shape[0],
        hidden_act=act,
        deepstack_visual_indexes=tuple(i for i, mark in enumerate(marks) if mark),
        patch_size=need(vision.PATCH_SIZE),
        spatial_merge_size=need(vision.SPATIAL_MERGE_SIZE, 2),
    )
    tensors = {}
    for info in gg.tensors.values():
        if not info.name.startswith(skip):
            tensors[info.name] = encoder_tensor(gg, info).float()
    weights = _hf_weights(tensors, args, gg.path)
    processor = pixel_settings(gg, need, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, gg.path, processor)


def _hf_weights(tensors: dict[str, torch.Tensor], args: EncoderArgs, source: Path) -> dict:
    """The mmproj's tensors under HF's names, the patch weight's frames stacked again and
    each deepstack merger (v.deepstack.BLOCK.*) numbered among the marked blocks'."""

    def deepstack(parts: list[str], name: str) -> str | None:
        if not (len(parts) == 4 and parts[:2] == ["v", "deepstack"] and parts[2].isdigit()):
            return None
        block, layer = int(parts[2]), _GGUF_DEEPSTACK.get(parts[3])
        if layer is None or block not in args.deepstack_visual_indexes:
            raise ModelFormatError(
                f"{source}: tensor {name!r} is not a deepstack merger of a block that "
                f"{Keys.ClipVision.IS_DEEPSTACK_LAYERS} marks"
            )
        return f"deepstack_merger_list.{args.deepstack_visual_indexes.index(block)}.{layer}"

    return tower_weights(tensors, _GGUF_NAMES, _GGUF_LAYER, source, deepstack)


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    processor: dict[str, Any],
) -> Qwen3Vision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(VisionModel, args, weights, source, (args.out_hidden_size, text_hidden))
    return Qwen3Vision(encoder, **processor)
