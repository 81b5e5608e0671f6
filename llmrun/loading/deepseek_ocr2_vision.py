"""DeepSeek-OCR 2's image encoder from either format: its Hugging Face folder
(DeepseekOcr2ForConditionalGeneration, model_type deepseek_ocr2; the checkpoint's keys are
DeepSeek's own, as transformers saves them: model.sam_model.*, model.qwen2_model.*,
model.projector.*, model.view_seperator), or the mmproj GGUF that llama.cpp's converter
writes beside the text model's GGUF (conversion/deepseek.py DeepseekOCR2VisionModel:
projector type deepseekocr2, v.sam.* and v.blk.* tensors). Both give the encoder HF's
weights. Images are prepared as the folder's image processor says: the whole image resized
into `size` and padded to a square, and where it is larger than a crop, crops of a grid of
tiles.

An mmproj is read as llama.cpp's clip.cpp reads it, with the values it fixes rather than
reads: 16-pixel patches, a 1024-pixel whole view and 768-pixel crops, SAM's global
attention in layers 2, 5, 8 and 11, the query layers' RoPE base 1e6; images are prepared
as transformers does for either format (llama.cpp's own resizing differs in rounding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import deepseek, gguf_io, safetensors_io
from llmrun.loading.vision import (
    image_processor,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    prefixed_weights,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models import deepseek_ocr2_vision as model
from llmrun.models.base import args_from_config

MODEL_TYPE = "deepseek_ocr2"
# gguf 0.19 names neither this projector type nor the vision head_count_kv key (llama.cpp's
# gguf-py does: VisionProjectorType.DEEPSEEKOCR2, Keys.ClipVision.Attention.HEAD_COUNT_KV).
PROJECTOR = "deepseekocr2"
HEAD_COUNT_KV = "clip.vision.attention.head_count_kv"
# What clip.cpp fixes for this projector (clip_model_loader::load_hparams, clip-model.h
# global_attn_indices, deepseekocr2.cpp's RoPE).
_GGUF_PATCH, _GGUF_SAM_GLOBAL, _GGUF_QUERY_THETA = 16, (2, 5, 8, 11), 1000000.0
_HF_PREFIXES = {
    "model.sam_model.": "sam_model.",
    "model.qwen2_model.": "qwen2_model.",
    "model.projector.": "projector.",
    "model.view_seperator": "view_seperator",
}
# DeepseekOcr2ImageProcessor's defaults (IMAGENET_STANDARD_MEAN and _STD).
_MEAN_STD = (0.5, 0.5, 0.5)
_SIZE, _TILE, _MIN_CROPS, _MAX_CROPS = 1024, 768, 2, 6
_BACKGROUND = (127, 127, 127)
# The SAM grid's downsampling by its two stride-2 convolutions (the processor's
# downsample_ratio).
_DOWNSAMPLE = 4


@dataclass
class DeepseekOcr2Vision:
    """A loaded DeepSeek-OCR 2 image encoder and how images are prepared for it: the whole
    image into `size` pixels, padded with `background`; crops of `tile` pixels, from
    `min_crops` to `max_crops` of them, where its longer side is over `tile`."""

    encoder: model.ImageEncoder
    size: int
    tile: int
    min_crops: int
    max_crops: int
    background: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    global_tokens: int
    crop_tokens: int


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a DeepSeek-OCR 2 with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a DeepSeek-OCR 2 with its vision tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is DeepSeek V1's, which DeepSeek-OCR 2's and
    Unlimited-OCR's text runs as."""
    return config.get("model_type") == deepseek.MODEL_TYPE


def sub_config(vision: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    """The vision_config's sub-config `key` (SAM's, the encoder's), refused if not a dict."""
    sub = vision.get(key, {})
    if not isinstance(sub, dict):
        raise ModelFormatError(f"{path}: vision_config.{key} is {sub!r}, not a config")
    return sub


def encoder_args(config: dict[str, Any], path: Path) -> model.EncoderArgs:
    """The encoder's shape from a DeepSeek-OCR 2 config.json."""
    vision, text = config["vision_config"], config.get("text_config")
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a DeepSeek-OCR 2 config without its text_config's width")
    sam = sam_args(sub_config(vision, "sam_config", path), path)
    queries_config = sub_config(vision, "encoder_config", path)
    queries = args_from_config(model.QueryArgs, queries_config)
    if queries_config.get("num_key_value_heads") is None:
        queries.num_key_value_heads = queries.num_attention_heads
    rope_type = queries.rope_parameters["rope_type"]
    if rope_type != "default":
        raise UnsupportedError(
            f"{path}: the vision encoder's rope_type {rope_type!r} (llmrun runs default)"
        )
    act = queries_config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(
            f"{path}: vision_config.encoder_config.hidden_act {act!r} is not supported ('silu')"
        )
    if sam.downsample_channels[-1] != queries.hidden_size:
        raise ModelFormatError(
            f"{path}: SAM gives {sam.downsample_channels[-1]} features, its query layers take "
            f"{queries.hidden_size}"
        )
    return model.EncoderArgs(sam, queries, text["hidden_size"])


def sam_args(sam_config: dict[str, Any], path: Path) -> model.SamArgs:
    """SAM's shape from the vision_config's sam_config (SamVisionConfig's mlp_dim where it
    names none), refused where it asks for what llmrun's SAM does not run."""
    names = {f.name for f in dataclasses.fields(model.SamArgs)}
    sam = model.SamArgs(**{k: v for k, v in sam_config.items() if k in names and v is not None})
    if sam_config.get("mlp_dim") is None:  # SamVisionConfig's: hidden_size * mlp_ratio
        sam.mlp_dim = int(sam.hidden_size * sam_config.get("mlp_ratio", 4.0))
    for name, value, runs in (
        ("use_abs_pos", sam_config.get("use_abs_pos", True), True),
        ("use_rel_pos", sam_config.get("use_rel_pos", True), True),
        ("qkv_bias", sam_config.get("qkv_bias", True), True),
        ("hidden_act", sam_config.get("hidden_act", "gelu"), "gelu"),
    ):
        if value != runs:
            raise UnsupportedError(
                f"{path}: vision_config.sam_config.{name} {value!r} is not supported ({runs!r})"
            )
    return sam


def from_hf_dir(path: Path, text_hidden: int) -> DeepseekOcr2Vision:
    """DeepSeek-OCR 2's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a DeepSeek-OCR 2 folder with a vision_config")
    args = encoder_args(config, path)
    source, settings = image_processor(path)
    crops = crop_settings(source, settings, _SIZE, _TILE, _MIN_CROPS, _MAX_CROPS)
    size, tile = crops.size, crops.tile
    global_tokens = _view_tokens(args, size, source)
    crop_tokens = _view_tokens(args, tile, source)
    encoder = with_weights(
        model.ImageEncoder,
        args,
        prefixed_weights(path, _HF_PREFIXES),
        path,
        (args.text_hidden_size, text_hidden),
    )
    return DeepseekOcr2Vision(
        encoder,
        size,
        tile,
        crops.min_crops,
        crops.max_crops,
        crops.background,
        crops.mean,
        crops.std,
        global_tokens,
        crop_tokens,
    )


@dataclass(frozen=True)
class CropSettings:
    """How a DeepSeek-OCR-style image processor cuts an image: the whole view's side, a
    crop's side, the range of crops, the padding colour, the normalization."""

    size: int
    tile: int
    min_crops: int
    max_crops: int
    background: tuple[int, int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def crop_settings(
    source: Path, settings: dict[str, Any], size: int, tile: int, min_crops: int, max_crops: int
) -> CropSettings:
    """The image processor's `settings` (read from `source`) over a family's defaults, checked:
    a square size, a tile size and a range of crops, crops on, an RGB background."""
    side = settings.get("size", {"height": size, "width": size})
    side = (
        side.get("height")
        if isinstance(side, dict) and side.get("height") == side.get("width")
        else None
    )
    tile = settings.get("tile_size", tile)
    min_crops = settings.get("min_patches", min_crops)
    max_crops = settings.get("max_patches", max_crops)
    if (
        not all(positive_int(v) for v in (side, tile, min_crops, max_crops))
        or min_crops > max_crops
    ):
        raise ModelFormatError(
            f"{source}: size, tile_size, min_patches and max_patches are not a square size, "
            "a tile size and a range of crops"
        )
    if not settings.get("crop_to_patches", True):
        raise UnsupportedError(
            f"{source}: crop_to_patches false (llmrun prepares images as the processor "
            "does with crops)"
        )
    background = settings.get("background_color", _BACKGROUND)
    colour = isinstance(background, list | tuple) and len(background) == 3
    if not colour or not all(isinstance(v, int) and 0 <= v <= 255 for v in background):
        raise ModelFormatError(f"{source}: background_color is {background!r}, not an RGB colour")
    mean = three_floats(settings.get("image_mean", _MEAN_STD), source, "image_mean")
    std = three_floats(settings.get("image_std", _MEAN_STD), source, "image_std")
    return CropSettings(side, tile, min_crops, max_crops, tuple(background), mean, std)


def _view_tokens(args: model.EncoderArgs, side: int, source: Path) -> int:
    """The tokens of a view `side` pixels square: as many as the queries the encoder takes
    for its grid, which must be what DeepseekOcr2Processor counts (its side in patches over
    the downsampling, squared)."""
    grid = -(-side // args.sam.patch_size)
    for _ in range(2):  # the two stride-2 convolutions
        grid = -(-grid // 2)
    queries = args.crop_queries if grid * grid <= args.crop_queries else args.global_queries
    counted = math.ceil(side / args.sam.patch_size / _DOWNSAMPLE) ** 2
    if side % args.sam.patch_size or queries != counted:
        raise ModelFormatError(
            f"{source}: a view of {side} pixels gives {queries} query tokens, but the "
            f"processor counts {counted}"
        )
    return queries


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type deepseekocr2 (read_gguf's checks)."""
    return projector_type(path) == PROJECTOR


# mmproj names -> the encoder's (conversion/deepseek.py through gguf-py's tensor_mapping).
_GGUF_NAMES = {
    "v.sam.pos_embd.weight": "sam_model.pos_embed",
    "v.sam.patch_embd.weight": "sam_model.patch_embed.proj.weight",
    "v.sam.patch_embd.bias": "sam_model.patch_embed.proj.bias",
    "v.sam.net_2.weight": "sam_model.net_2.weight",
    "v.sam.net_3.weight": "sam_model.net_3.weight",
    **{
        f"v.sam.neck.{i}.{s}": f"sam_model.neck.{i}.{s}"
        for i in range(4)
        for s in ("weight", "bias")
    },
    "v.resample_query_768.weight": "qwen2_model.query_768.weight",
    "v.resample_query_1024.weight": "qwen2_model.query_1024.weight",
    "v.post_ln.weight": "qwen2_model.model.model.norm.weight",
    "mm.model.fc.weight": "projector.layers.weight",
    "mm.model.fc.bias": "projector.layers.bias",
    "v.view_seperator": "view_seperator",
}
_SAM_LAYER = {
    "pre_ln": "norm1",
    "post_ln": "norm2",
    "attn.qkv": "attn.qkv",
    "attn.out": "attn.proj",
    "attn.pos_h": "attn.rel_pos_h",
    "attn.pos_w": "attn.rel_pos_w",
    "mlp.lin1": "mlp.lin1",
    "mlp.lin2": "mlp.lin2",
}
_QUERY_LAYER = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if parts[:3] == ["v", "sam", "blk"] and len(parts) >= 6 and parts[3].isdigit():
        layer = _SAM_LAYER.get(".".join(parts[4:-1]))
        if layer is not None and parts[-1] in ("weight", "bias"):
            # rel_pos_h/w are parameters, not modules: the converter added ".weight"
            suffix = "" if layer.startswith("attn.rel_pos") else f".{parts[-1]}"
            return f"sam_model.blocks.{parts[3]}.{layer}{suffix}"
    if parts[:2] == ["v", "blk"] and len(parts) == 5 and parts[2].isdigit():
        layer = _QUERY_LAYER.get(parts[3])
        if layer is not None and parts[4] in ("weight", "bias"):
            return f"qwen2_model.model.model.layers.{parts[2]}.{layer}.{parts[4]}"
    return None


def from_mmproj(path: str | Path, text_hidden: int) -> DeepseekOcr2Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type deepseekocr2)."""
    gg, need = open_mmproj(path, PROJECTOR)
    vision = Keys.ClipVision
    weights = mmproj_tensors(gg, _gguf_name, "DeepSeek-OCR 2's encoder")
    if "view_seperator" in weights:  # [1, hidden] in the file
        weights["view_seperator"] = weights["view_seperator"].flatten()
    shapes = {name: tuple(w.shape) for name, w in weights.items()}
    sam = mmproj_sam(gg, need, shapes, _SIZE)
    queries = model.QueryArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        num_key_value_heads=need(HEAD_COUNT_KV),
        rms_norm_eps=need(vision.Attention.LAYERNORM_EPS),
        rope_parameters={"rope_type": "default", "rope_theta": _GGUF_QUERY_THETA},
    )
    args = model.EncoderArgs(sam, queries, need(vision.PROJECTION_DIM))
    min_crops, max_crops, mean, std = mmproj_crops(gg, _MIN_CROPS, _MAX_CROPS, _MEAN_STD)
    encoder = with_weights(
        model.ImageEncoder, args, weights, gg.path, (args.text_hidden_size, text_hidden)
    )
    return DeepseekOcr2Vision(
        encoder,
        _SIZE,
        _TILE,
        min_crops,
        max_crops,
        _BACKGROUND,
        mean,
        std,
        _view_tokens(args, _SIZE, gg.path),
        _view_tokens(args, _TILE, gg.path),
    )


def tensor_rows(shapes: dict[str, tuple[int, ...]], name: str, source: Path) -> int:
    """The rows of the encoder tensor `name` of an mmproj (`shapes` under the encoder's
    names), refused where the file lacks it."""
    if name not in shapes:
        raise ModelFormatError(f"{source}: the encoder tensor {name} is missing")
    return shapes[name][0]


def mmproj_sam(
    gg: gguf_io.GGUFFile,
    need: Callable[..., Any],
    shapes: dict[str, tuple[int, ...]],
    size: int,
) -> model.SamArgs:
    """SAM's shape in a DeepSeek-OCR mmproj (DeepSeek-OCR 2's or Unlimited-OCR's): its
    metadata (`need`, open_mmproj's), its tensors' `shapes` under the encoder's names, and
    what clip.cpp fixes (16-pixel patches, global attention in layers 2, 5, 8 and 11), for
    whole views of `size` pixels."""
    vision = Keys.ClipVision
    layers = need(vision.SAM.BLOCK_COUNT)
    patch_grid = shapes.get("sam_model.pos_embed", (0, 0))[1]
    if patch_grid * _GGUF_PATCH != size:
        raise ModelFormatError(
            f"{gg.path}: SAM's position embeddings are not the {size // _GGUF_PATCH}-patch "
            f"grid that llama.cpp takes"
        )

    def rows(name: str) -> int:
        return tensor_rows(shapes, name, gg.path)

    return model.SamArgs(
        hidden_size=need(vision.SAM.EMBEDDING_LENGTH),
        output_channels=rows("sam_model.neck.0.weight"),
        num_hidden_layers=layers,
        num_attention_heads=need(vision.SAM.HEAD_COUNT),
        image_size=size,
        patch_size=_GGUF_PATCH,
        mlp_dim=rows("sam_model.blocks.0.mlp.lin1.weight"),
        window_size=need(vision.WINDOW_SIZE),
        global_attn_indexes=[i for i in _GGUF_SAM_GLOBAL if i < layers],
        downsample_channels=[rows("sam_model.net_2.weight"), rows("sam_model.net_3.weight")],
    )


def mmproj_crops(
    gg: gguf_io.GGUFFile, min_crops: int, max_crops: int, mean_std: tuple[float, float, float]
) -> tuple[int, int, tuple[float, float, float], tuple[float, float, float]]:
    """An mmproj's range of crops and its mean and std, checked; a family's defaults
    (`min_crops`, `max_crops`, `mean_std`) where the file names none."""
    meta, vision = gg.metadata, Keys.ClipVision
    min_crops = meta.get(vision.PREPROC_MIN_TILES, min_crops)
    max_crops = meta.get(vision.PREPROC_MAX_TILES, max_crops)
    if not (positive_int(min_crops) and positive_int(max_crops)) or min_crops > max_crops:
        raise ModelFormatError(
            f"{gg.path}: preproc_min_tiles {min_crops!r} and preproc_max_tiles {max_crops!r} "
            "are not a range of crops"
        )
    mean = three_floats(meta.get(vision.IMAGE_MEAN, mean_std), gg.path, "image_mean")
    std = three_floats(meta.get(vision.IMAGE_STD, mean_std), gg.path, "image_std")
    return min_crops, max_crops, mean, std
