"""Qwen2-VL's and Qwen2.5-VL's vision tower (llmrun.models.qwen2_vl_vision) from either
format: the Hugging Face folder's visual.* tensors (model.visual.* as transformers 5 names
them in memory) and its preprocessor_config.json, or the mmproj GGUF that llama.cpp's
converter writes (conversion/qwenvl.py Qwen2VLVisionModel; tools/mtmd/clip.cpp reads it):
projector type qwen2vl_merger or qwen2.5vl_merger, the Conv3d patch weight split into its
two frames (v.patch_embd.weight and .weight.1), each block's qkv split into attn_q, attn_k
and attn_v, the window attention's pattern as n_wa_pattern (every n-th block full); the
older conversion script's files name the MLP matrices the other way round. EXAONE 4.5's
mmproj (conversion/exaone.py Exaone4_5VisionModel: projector type exaone4_5) keeps each
block's qkv whole (attn_qkv, grouped-query: attention.head_count_kv) and writes the
config's window_size, which llmrun reads as transformers does (clip.cpp runs 112-pixel
windows whatever it says). Both give the encoder HF's weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.vision import (
    encoder_tensor,
    pixel_settings,
    three_floats,
    with_weights,
)
from llmrun.models.qwen2_vl_vision import QWEN2_5_VL, QWEN2_VL, EncoderArgs, VisionModel

MODEL_TYPES = (QWEN2_VL, QWEN2_5_VL)
# Qwen2VLImageProcessor's defaults (OpenAI CLIP's mean and std; 4 to 1280 merged tokens).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280
_HF_PREFIXES = ("model.visual.", "visual.")
_PROJECTORS = {VisionProjectorType.QWEN2VL: QWEN2_VL, VisionProjectorType.QWEN25VL: QWEN2_5_VL}
# gguf 0.19 names neither this projector type nor the vision head_count_kv key (llama.cpp's
# gguf-py does: VisionProjectorType.EXAONE4_5, Keys.ClipVision.Attention.HEAD_COUNT_KV).
EXAONE4_5_PROJECTOR = "exaone4_5"
HEAD_COUNT_KV = "clip.vision.attention.head_count_kv"
# clip.cpp's names of a block's tensors -> the block's (Qwen2.5-VL's MLP, Qwen2-VL's).
_GGUF_LAYER = {
    "attn_qkv": "attn.qkv",  # EXAONE 4.5's, kept whole
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
}
_GGUF_MLP = {
    QWEN2_5_VL: {"ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    QWEN2_VL: {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
}
_GGUF_NAMES = {
    "v.post_ln": "merger.ln_q",
    "mm.0": "merger.mlp.0",
    "mm.2": "merger.mlp.2",
}
PATCH = "v.patch_embd.weight"


@dataclass
class QwenVision:
    """A loaded Qwen2-VL or Qwen2.5-VL vision tower and how images are prepared for it
    (Qwen2VLImageProcessor's settings)."""

    encoder: VisionModel
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a Qwen2-VL's or Qwen2.5-VL's with
    its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


def turns_by_mrope(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config (either RoPE style) has M-RoPE's sections."""
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    return bool(rope.get("mrope_section"))


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen2-VL's or Qwen2.5-VL's: Qwen2's with M-RoPE
    sections (Qwen3-VL's and GLM-4V's turn by M-RoPE too, and take other towers)."""
    return text_config.get("model_type") == "qwen2" and turns_by_mrope(text_config)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Qwen2-VL's or Qwen2.5-VL's."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return _projector(meta) in _PROJECTORS


def _projector(meta: dict[str, Any]) -> Any:
    return meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))


def visual_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A folder's vision-tower tensors (`model.visual.*` or `visual.*`), named as the
    tower's own: the layout of Qwen2-VL, Qwen3-VL and GLM-4V folders alike."""
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            prefix = next((p for p in _HF_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                weights[name[len(prefix) :]] = tensor
    return weights


def from_hf_dir(path: Path, text_hidden: int) -> QwenVision:
    """The vision tower of a Qwen2-VL or Qwen2.5-VL folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    args = EncoderArgs.from_config(config)
    weights = visual_tensors(path)
    processor = processor_settings(path, args)
    return _build(args, weights, text_hidden, path, processor)


def processor_settings(
    path: Path,
    args: Any,
    mean: tuple[float, ...] = CLIP_MEAN,
    std: tuple[float, ...] = CLIP_STD,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> dict[str, Any]:
    """A folder's preprocessor_config.json's mean, std and pixel limits (the defaults
    given where it has none: Qwen2VLImageProcessor's), its patch sizes checked against
    the encoder's `args` (patch_size, spatial_merge_size, temporal_patch_size)."""
    file = path / "preprocessor_config.json"
    settings: dict[str, Any] = {}
    if file.is_file():
        try:
            settings = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    for key, expected in (
        ("patch_size", args.patch_size),
        ("merge_size", args.spatial_merge_size),
        ("temporal_patch_size", args.temporal_patch_size),
    ):
        if settings.get(key, expected) != expected:
            raise ModelFormatError(
                f"{file}: {key} is {settings[key]!r}, but the vision tower's is {expected}"
            )
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    limits = []
    for key, alias, default in (
        ("min_pixels", "shortest_edge", min_pixels),
        ("max_pixels", "longest_edge", max_pixels),
    ):
        value = settings.get(key, size.get(alias, default))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFormatError(f"{file}: {key} is {value!r}")
        limits.append(value)
    if limits[0] > limits[1]:
        raise ModelFormatError(f"{file}: min_pixels {limits[0]} > max_pixels {limits[1]}")
    return dict(
        mean=three_floats(settings.get("image_mean", mean), file, "image_mean"),
        std=three_floats(settings.get("image_std", std), file, "image_std"),
        min_pixels=limits[0],
        max_pixels=limits[1],
    )


def open_vision_mmproj(
    path: str | Path, projectors: tuple[Any, ...], family: str
) -> tuple[gguf_io.GGUFFile, Any, Callable[..., int]]:
    """An mmproj GGUF that must hold a vision encoder of one of the projector types
    `projectors` (else it is not `family`'s), its projector type, and its `need(key,
    default=None, value=None)`: a positive whole number from the metadata (or `value`),
    else one error naming the key."""
    gg = gguf_io.read_gguf(path)
    meta = gg.metadata
    kind = _projector(meta)
    if kind is None or not meta.get(Keys.Clip.HAS_VISION_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with a vision encoder")
    if kind not in projectors:
        raise UnsupportedError(f"{gg.path}: projector type {kind!r} is not {family}'s")

    def need(key: str, default: int | None = None, value: Any = None) -> int:
        value = meta.get(key, default) if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    return gg, kind, need


def from_mmproj(path: str | Path, text_hidden: int, skip: tuple[str, ...] = ()) -> QwenVision:
    """The vision tower of llama.cpp's mmproj GGUF (projector qwen2vl_merger or
    qwen2.5vl_merger, or qwen2.5o: Qwen2.5-Omni's, whose tower is Qwen2.5-VL's, or
    exaone4_5: EXAONE 4.5's), the tensors whose names begin with one of `skip` left out
    (another encoder's)."""
    projectors = (*_PROJECTORS, VisionProjectorType.QWEN25O, EXAONE4_5_PROJECTOR)
    gg, kind, need = open_vision_mmproj(path, projectors, "Qwen2-VL")
    meta = gg.metadata
    exaone = kind == EXAONE4_5_PROJECTOR
    family = _PROJECTORS.get(kind, QWEN2_5_VL)
    vision = Keys.ClipVision
    depth = need(vision.BLOCK_COUNT)
    fullatt: tuple[int, ...] = tuple(range(depth))
    act = "quick_gelu"  # clip.cpp's FFN unless the file says gelu or silu
    if meta.get(vision.USE_SILU, False):
        act = "silu"
    elif meta.get(vision.USE_GELU, False):
        act = "gelu"
    if family == QWEN2_5_VL:
        # clip.cpp: block i attends to the whole image where (i + 1) % n_wa_pattern == 0.
        pattern = need(vision.N_WA_PATTERN)
        fullatt = tuple(i for i in range(depth) if (i + 1) % pattern == 0)
    width = need(vision.EMBEDDING_LENGTH)
    inner = meta.get(vision.FEED_FORWARD_LENGTH)
    up = gg.tensors.get("v.blk.0.ffn_up.weight")
    if inner == 0 and up is not None:
        # The older conversion script's files say 0: the MLP's matrices tell.
        inner = next((d for d in up.shape if d != width), width)
    args = EncoderArgs(
        family=family,
        hidden_size=width,
        intermediate_size=need(vision.FEED_FORWARD_LENGTH, value=inner),
        depth=depth,
        num_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        hidden_act=act,
        patch_size=need(vision.PATCH_SIZE),
        spatial_merge_size=need(vision.SPATIAL_MERGE_SIZE, 2),
        fullatt_block_indexes=fullatt,
        window_size=need(vision.WINDOW_SIZE, 112) if exaone else 112,
        num_key_value_heads=need(HEAD_COUNT_KV) if exaone else None,
    )
    tensors = {}
    for info in gg.tensors.values():
        if not info.name.startswith(skip):
            tensors[info.name] = encoder_tensor(gg, info).float()
    weights = _hf_weights(tensors, family, args.hidden_size, gg.path)
    processor = pixel_settings(gg, need, CLIP_MEAN, CLIP_STD, MIN_PIXELS, MAX_PIXELS)
    return _build(args, weights, text_hidden, gg.path, processor)


def _hf_weights(tensors: dict[str, torch.Tensor], family: str, width: int, source: Path) -> dict:
    """The mmproj's tensors under HF's names, the converter's splits undone (blocks of
    `width` features)."""
    weights = {}
    split: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name in (PATCH, PATCH + ".1"):
            continue
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        if stem in _GGUF_NAMES and suffix in ("weight", "bias"):
            weights[f"{_GGUF_NAMES[stem]}.{suffix}"] = tensor
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit():
            block, kind = f"blocks.{parts[2]}", parts[3]
            if kind in ("attn_q", "attn_k", "attn_v") and suffix in ("weight", "bias"):
                split.setdefault(f"{block}.attn.qkv.{suffix}", {})[kind] = tensor
                continue
            layer = _GGUF_LAYER.get(kind) or _GGUF_MLP[family].get(kind)
            if layer is None or suffix not in ("weight", "bias"):
                raise UnsupportedError(f"{source}: tensor {name!r} is not part of the tower")
            weights[f"{block}.{layer}.{suffix}"] = tensor
        else:
            raise UnsupportedError(f"{source}: tensor {name!r} is not part of the tower")
    _unswap_ffn(weights, width)
    for name, pieces in split.items():
        if set(pieces) != {"attn_q", "attn_k", "attn_v"}:
            raise ModelFormatError(f"{source}: {name} lacks some of attn_q, attn_k and attn_v")
        weights[name] = torch.cat([pieces["attn_q"], pieces["attn_k"], pieces["attn_v"]])
    weights["patch_embed.proj.weight"] = conv3d_patch_weight(tensors, source)
    return weights


def tower_weights(
    tensors: dict[str, torch.Tensor],
    names: dict[str, str],
    layers: dict[str, str],
    source: Path,
    other: Callable[[list[str], str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """An mmproj's tensors under HF's names, the patch weight's frames stacked again: the
    modules of `names` (mmproj module -> HF module), each block's of `layers` (v.blk.N.x
    -> blocks.N.layers[x]), and the modules `other` names (given an mmproj module's parts
    and the tensor's name; None where it is not one of them). Any other tensor is refused."""
    weights = {}
    for name, tensor in tensors.items():
        if name in (PATCH, PATCH + ".1"):
            continue
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        known = suffix in ("weight", "bias")
        if stem in names and known:
            weights[f"{names[stem]}.{suffix}"] = tensor
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and known:
            layer = layers.get(parts[3])
            if layer is None:
                raise UnsupportedError(f"{source}: tensor {name!r} is not part of the tower")
            weights[f"blocks.{parts[2]}.{layer}.{suffix}"] = tensor
        elif known and other is not None and (module := other(parts, name)) is not None:
            weights[f"{module}.{suffix}"] = tensor
        else:
            raise UnsupportedError(f"{source}: tensor {name!r} is not part of the tower")
    weights["patch_embed.proj.weight"] = conv3d_patch_weight(tensors, source)
    return weights


def conv3d_patch_weight(tensors: dict[str, torch.Tensor], source: Path) -> torch.Tensor:
    """The Conv3d patch weight [out, C, 2, P, P] from the two Conv2d weights [out, C, P, P],
    one per frame, that llama.cpp's converter stores it as (v.patch_embd.weight and .1)."""
    frames = [tensors.get(PATCH), tensors.get(PATCH + ".1")]
    if frames[0] is None or frames[1] is None or frames[0].shape != frames[1].shape:
        raise ModelFormatError(f"{source}: no {PATCH} and {PATCH}.1 of one shape")
    return torch.stack(frames, dim=2)


def _unswap_ffn(weights: dict[str, torch.Tensor], width: int) -> None:
    """Files from the older conversion scripts name each block's MLP input matrix ffn_down
    and its output ffn_up; clip.cpp swaps them back where ffn_down takes the blocks' width
    (its ne[0], torch's shape[1]) and gives something else, as here."""
    for down in [n for n in weights if n.endswith((".mlp.down_proj.weight", ".mlp.fc2.weight"))]:
        up = down.replace("down_proj", "up_proj").replace("fc2", "fc1")
        if up not in weights or weights[down].ndim != 2:
            continue  # _build names what is missing or misshapen
        rows, columns = weights[down].shape
        if columns != width or rows == width:
            continue
        for suffix in ("weight", "bias"):
            a, b = down.replace("weight", suffix), up.replace("weight", suffix)
            if a in weights and b in weights:
                weights[a], weights[b] = weights[b], weights[a]


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    processor: dict[str, Any],
) -> QwenVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(VisionModel, args, weights, source, (args.out_hidden_size, text_hidden))
    return QwenVision(encoder, **processor)
