"""Kimi K2.5's image encoder (MoonViT and its projector) from either format: its Hugging
Face folder (KimiK25ForConditionalGeneration, model_type kimi_k25; the Hub's tensor names:
vision_tower.patch_embed.*, vision_tower.encoder.blocks.N.{norm0,norm1,wqkv,wo,mlp.fc0,
mlp.fc1}, vision_tower.encoder.final_layernorm, mm_projector.pre_norm and
mm_projector.proj.0/2), or the mmproj GGUF that llama.cpp's converter writes beside the
text model's GGUF (conversion/kimivl.py KimiK25Model: projector type kimik25, wqkv kept
as v.blk.N.attn_qkv). Both give the encoder transformers' weights: the Hub's queries and
keys turn interleaved pairs (transformers' PermuteForRope reorders them for rotate_half),
the converter's turn each head's column pairs, then its row pairs (its own permute,
undone here).

config.json's vision_config is read under transformers' names (hidden_size,
pos_emb_height, ...) or the Hub's first ones (vt_hidden_size, init_pos_emb_height, ...);
the image processor's settings under transformers' names (max_patches, size.max_height)
or the Hub's media_proc_cfg (in_patch_limit, patch_limit_on_one_side). An mmproj gives
the most patches as image_max_pixels; its side limit is the processor's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    projector_type,
    three_floats,
    with_suffixes,
    with_weights,
)
from llmrun.models.kimi_k25_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "kimi_k25"
TEXT_MODEL_TYPE = "deepseek_v3"
# gguf 0.19 does not name this projector type (llama.cpp's gguf-py does:
# VisionProjectorType.KIMIK25).
PROJECTOR = "kimik25"
# Kimi_K25ImageProcessor's defaults (IMAGENET_STANDARD_MEAN and _STD).
MEAN_STD = (0.5, 0.5, 0.5)
MAX_PATCHES, MAX_SIDE = 16384, 512
# vision_config field -> the Hub's first name for it, and transformers' default.
_VISION_FIELDS = {
    "hidden_size": ("vt_hidden_size", 1152),
    "intermediate_size": ("vt_intermediate_size", 4304),
    "num_hidden_layers": ("vt_num_hidden_layers", 27),
    "num_attention_heads": ("vt_num_attention_heads", 16),
    "pos_emb_height": ("init_pos_emb_height", 64),
    "pos_emb_width": ("init_pos_emb_width", 64),
    "patch_size": ("patch_size", 14),
}
_TOWER, _BLOCKS = "vision_tower.", "vision_tower.encoder.blocks."
_HF_NAMES = {
    "vision_tower.patch_embed.pos_emb.weight": "vision_tower.patch_embed.pos_emb."
    "position_embeddings",
    **with_suffixes(
        {
            "vision_tower.patch_embed.proj": "vision_tower.patch_embed.proj",
            "vision_tower.encoder.final_layernorm": "vision_tower.final_layernorm",
            "mm_projector.pre_norm": "mm_projector.pre_norm",
            "mm_projector.proj.0": "mm_projector.in_proj",
            "mm_projector.proj.2": "mm_projector.out_proj",
        }
    ),  # fmt: skip
}
# A Hub block's modules -> the encoder layer's (wqkv is split apart).
_HF_LAYER = {
    "norm0": "norm1",
    "norm1": "norm2",
    "wo": "attn.proj",
    "mlp.fc0": "mlp.fc1",
    "mlp.fc1": "mlp.fc2",
}
# The Hub's fixed table of frames, which adds nothing to an image (transformers computes it).
_UNUSED = "vision_tower.patch_embed.pos_emb.time_weight"
_GGUF_NAMES = {
    "v.position_embd.weight": "vision_tower.patch_embed.pos_emb.position_embeddings",
    **with_suffixes(
        {
            "v.patch_embd": "vision_tower.patch_embed.proj",
            "v.post_ln": "vision_tower.final_layernorm",
            "mm.input_norm": "mm_projector.pre_norm",
            "mm.1": "mm_projector.in_proj",
            "mm.2": "mm_projector.out_proj",
        }
    ),  # fmt: skip
}
_GGUF_LAYER = {
    "attn_qkv": "attn.qkv",  # split apart after
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


@dataclass
class KimiK25Vision:
    """A loaded Kimi K2.5 image encoder and how images are prepared for it
    (Kimi_K25ImageProcessor's settings: at most `max_patches` patches, `max_side` a side)."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    max_patches: int = MAX_PATCHES
    max_side: int = MAX_SIDE

    @property
    def patch_size(self) -> int:
        return self.encoder.args.patch_size

    @property
    def merge_size(self) -> int:
        return self.encoder.args.merge_size


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Kimi K2.5 with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Kimi K2.5 with its vision tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type kimik25 (read_gguf's checks)."""
    return projector_type(path) == PROJECTOR


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is DeepSeek-V3's, which Kimi K2.5's text is."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The encoder's shape from a Kimi K2.5 config.json."""
    vision, text = config["vision_config"], config.get("text_config")
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a Kimi K2.5 config without its text_config's width")
    sizes = {}
    for name, (hub_name, default) in _VISION_FIELDS.items():
        value = vision.get(name, vision.get(hub_name, default))
        if not positive_int(value):
            raise ModelFormatError(f"{path}: vision_config.{name} is {value!r}")
        sizes[name] = value
    merge = vision.get("merge_kernel_size", [2, 2])
    if not isinstance(merge, list) or len(merge) != 2 or merge[0] != merge[1]:
        raise UnsupportedError(
            f"{path}: vision_config.merge_kernel_size {merge!r} (llmrun runs n x n)"
        )
    if not positive_int(merge[0]):
        raise ModelFormatError(f"{path}: vision_config.merge_kernel_size is {merge!r}")
    projected = config.get(
        "projection_hidden_size", vision.get("mm_hidden_size", sizes["hidden_size"])
    )
    if projected != sizes["hidden_size"]:
        raise ModelFormatError(
            f"{path}: the projector normalizes {projected} features, the tower gives "
            f"{sizes['hidden_size']}"
        )
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise UnsupportedError(f"{path}: the vision rope_type {rope['rope_type']!r} (axial runs)")
    eps = config.get("projection_layer_norm_eps", vision.get("projector_ln_eps", 1e-5))
    try:
        return EncoderArgs(
            **sizes,
            out_hidden_size=text["hidden_size"],
            merge_size=merge[0],
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projection_eps=float(eps),
        )
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None


def processor_settings(path: Path) -> dict[str, Any]:
    """The image processor's mean, std, most patches and most patches a side."""
    source, settings = image_processor(path)
    hub = settings.get("media_proc_cfg")
    if isinstance(hub, dict):  # the Hub's first preprocessor_config.json
        settings = {
            **hub,
            "max_patches": hub.get("in_patch_limit", MAX_PATCHES),
            "size": {"max_height": hub.get("patch_limit_on_one_side", MAX_SIDE)},
        }
    size = settings.get("size", {"max_height": MAX_SIDE})
    side = size.get("max_height") if isinstance(size, dict) else None
    patches = settings.get("max_patches", MAX_PATCHES)
    if not positive_int(side) or not positive_int(patches):
        raise ModelFormatError(
            f"{source}: size {size!r} and max_patches {patches!r} are not counts of patches"
        )
    return dict(
        mean=three_floats(settings.get("image_mean", MEAN_STD), source, "image_mean"),
        std=three_floats(settings.get("image_std", MEAN_STD), source, "image_std"),
        max_patches=patches,
        max_side=side,
    )


def from_hf_dir(path: Path, text_hidden: int) -> KimiK25Vision:
    """Kimi K2.5's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Kimi K2.5 folder with a vision_config")
    args = encoder_args(config, path)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            if name in _HF_NAMES:
                weights[_HF_NAMES[name]] = tensor
            elif name.startswith(_BLOCKS):
                try:
                    weights.update(_hub_block_tensor(name, tensor, args))
                except ModelFormatError as e:
                    raise ModelFormatError(f"{path}: {e}") from None
            elif name.startswith(_TOWER) and name != _UNUSED:
                raise UnsupportedError(f"{path}: tensor {name!r} is not part of Kimi K2.5's tower")
    encoder = with_weights(ImageEncoder, args, weights, path, (args.out_hidden_size, text_hidden))
    return KimiK25Vision(encoder, **processor_settings(path))


def _hub_block_tensor(name: str, tensor: torch.Tensor, args: EncoderArgs) -> dict[str, Any]:
    """A Hub block tensor under the encoder's name; wqkv as the three projections, the
    queries' and keys' interleaved pairs reordered as transformers' PermuteForRope does."""
    layer, _, rest = name[len(_BLOCKS) :].partition(".")
    module, _, suffix = rest.rpartition(".")
    into = f"vision_tower.layers.{layer}."
    if module != "wqkv":
        return {into + _HF_LAYER.get(module, module) + "." + suffix: tensor}
    q, k, v = _thirds(tensor, name)
    heads = args.num_attention_heads
    return {
        f"{into}attn.q_proj.{suffix}": _halves_from_pairs(q, heads),
        f"{into}attn.k_proj.{suffix}": _halves_from_pairs(k, heads),
        f"{into}attn.v_proj.{suffix}": v,
    }


def _thirds(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] % 3:
        raise ModelFormatError(f"{name}: {tensor.shape[0]} rows are not queries, keys and values")
    return tensor.chunk(3)


def _halves_from_pairs(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Query or key rows whose heads hold interleaved pairs (the Hub's) in rotate_half's
    order: each head's even rows, then its odd ones."""
    if rows.shape[0] % (2 * heads):
        raise ModelFormatError(f"{rows.shape[0]} query or key rows are not {heads} heads")
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _halves_from_llama_cpp(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Query or key rows as the converter wrote them (each head's even pairs of the Hub's,
    those turned by columns, as its first half, its odd pairs as its second:
    KimiK25Model.permute) in rotate_half's order."""
    if rows.shape[0] % (4 * heads):
        raise ModelFormatError(f"{rows.shape[0]} query or key rows are not {heads} heads")
    quarter = rows.shape[0] // heads // 4
    # The converter's [heads, 2, quarter, 2] back to the Hub's [heads, quarter, 2, 2]
    pairs = rows.reshape(heads, 2, quarter, 2, *rows.shape[1:]).transpose(1, 2)
    return _halves_from_pairs(pairs.reshape(rows.shape), heads)


def from_mmproj(path: str | Path, text_hidden: int) -> KimiK25Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type kimik25)."""
    gg, need = open_mmproj(path, PROJECTOR)
    meta = gg.metadata
    vision = Keys.ClipVision
    position = gg.tensors.get("v.position_embd.weight")
    if position is None or len(position.shape) != 3:
        raise ModelFormatError(f"{gg.path}: no 3-D v.position_embd.weight")
    if meta.get(vision.USE_GELU) is False or meta.get(vision.USE_SILU):
        raise ModelFormatError(f"{gg.path}: Kimi K2.5's projector takes GELU, not another")
    patch = need(vision.PATCH_SIZE)
    sizes = dict(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        out_hidden_size=need(vision.PROJECTION_DIM),
        merge_size=need(vision.Projector.SCALE_FACTOR, 2),
        projection_eps=float(need(vision.Attention.LAYERNORM_EPS, 1e-5)),
    )
    tensors = mmproj_tensors(gg, _gguf_name, "Kimi K2.5's tower")
    try:
        args = EncoderArgs(
            **sizes,
            pos_emb_height=position.shape[0],
            pos_emb_width=position.shape[1],
            patch_size=patch,
        )
        weights = _split_qkv(tensors, args.num_attention_heads)
    except ModelFormatError as e:
        raise ModelFormatError(f"{gg.path}: {e}") from None
    max_pixels = need(vision.IMAGE_MAX_PIXELS, MAX_PATCHES * patch**2)
    encoder = with_weights(
        ImageEncoder, args, weights, gg.path, (args.out_hidden_size, text_hidden)
    )
    return KimiK25Vision(
        encoder,
        mean=three_floats(meta.get(vision.IMAGE_MEAN, MEAN_STD), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, MEAN_STD), gg.path, vision.IMAGE_STD),
        max_patches=max(1, max_pixels // patch**2),
    )


def _split_qkv(tensors: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """An mmproj's tensors (under the encoder's names), each attn.qkv as the three
    projections with the queries' and keys' rows in rotate_half's order."""
    weights = {}
    for name, tensor in tensors.items():
        if not name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            weights[name] = tensor
            continue
        into, _, suffix = name.rpartition("qkv.")
        q, k, v = _thirds(tensor, name)
        weights[f"{into}q_proj.{suffix}"] = _halves_from_llama_cpp(q, heads)
        weights[f"{into}k_proj.{suffix}"] = _halves_from_llama_cpp(k, heads)
        weights[f"{into}v_proj.{suffix}"] = v
    return weights


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, "vision_tower.layers.")
