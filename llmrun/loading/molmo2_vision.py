"""Molmo 2's image encoder (ViT and pooling adapter) from its Hugging Face folder
(Molmo2ForConditionalGeneration; its weights under AI2's names, as the Hub and
transformers' save_pretrained write them, or transformers' own), and how its processor
crops images and lays out their tokens (preprocessor_config.json or processor_config.json).
llama.cpp has no converter for it, so the folder is the one format; the language model
loads as for text (llmrun.loading.vl_text, llmrun.loading.molmo2_text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import image_processor, positive_int, three_floats, with_weights
from llmrun.models import molmo2_vision

MODEL_TYPE = "molmo2"
BILINEAR = 2  # Pillow's filter number, as preprocessor_config.json gives it
HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN and _STD
# AI2's names -> the encoder's (transformers' conversion_mapping "molmo2"), and
# transformers' own prefixes.
_RENAMES = (
    (r"^model\.vision_backbone\.image_vit\.transformer\.resblocks\.", "vision_tower.layers."),
    (r"^model\.vision_backbone\.image_vit\.", "vision_tower."),
    (r"^model\.vision_backbone\.", "multi_modal_projector."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    (r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."),
    (r"\.attention_norm\.", ".layer_norm1."),
    (r"\.ffn_norm\.", ".layer_norm2."),
    (r"\.feed_forward\.w1\.", ".mlp.fc1."),
    (r"\.feed_forward\.w2\.", ".mlp.fc2."),
    (r"image_pooling_2d\.w([qkvo])\.", r"image_pooling_2d.\1_proj."),
    (r"image_projector\.w1\.", "image_projector.gate_proj."),
    (r"image_projector\.w2\.", "image_projector.down_proj."),
    (r"image_projector\.w3\.", "image_projector.up_proj."),
)
_PREFIXES = ("model.vision_backbone.", "model.vision_tower.", "model.multi_modal_projector.")
_LAYER = re.compile(r"^vision_tower\.layers\.(\d+)\.")
# The tokens Molmo2Processor lays an image out in: the place a template marks, a pooled
# patch, a row's end, a crop's start, the whole image's start, an end.
PLACE, PATCH, COLUMN, START, LOW_RES_START, END = (
    "<|image|>", "<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>",
)  # fmt: skip


@dataclass
class Molmo2Vision:
    """A loaded Molmo 2 image encoder and how Molmo2ImageProcessor cuts images for it:
    square crops of `crop` pixels overlapping by `margins` patches, at most `max_crops`
    of them, and the whole image resized to one crop; `pooling` patches (rows, columns)
    a token; normalized by mean and std. Molmo2Processor's layout: a column token ending
    each row of the crops' tokens (`columns`) and of the whole image's
    (`low_res_columns`), the whole image's starting with <low_res_im_start>
    (`low_res_start`)."""

    encoder: molmo2_vision.ImageEncoder
    crop: int
    patch: int
    max_crops: int
    margins: tuple[int, int]
    pooling: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    columns: bool = True
    low_res_columns: bool = True
    low_res_start: bool = True
    patch_id: int = 151938  # Molmo2Config's image_patch_id


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is Molmo 2's with its vision tower (vit_config in AI2's)."""
    return config.get("model_type") == MODEL_TYPE and any(
        isinstance(config.get(k), dict) for k in ("vision_config", "vit_config")
    )


def folder_has_vision(path: Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "molmo2_text"


def is_mmproj(path: str | Path) -> bool:
    """No mmproj GGUF holds this encoder: llama.cpp does not convert it."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Molmo2Vision:
    """Refused: is_mmproj takes no file."""
    raise UnsupportedError(f"{path}: llmrun takes Molmo 2's images from its folder")


def _configs(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """vision_config and adapter_config under transformers' names (Molmo2VisionConfig's
    and Molmo2AdapterConfig's __post_init__ read AI2's)."""
    vision = dict(config.get("vision_config") or config.get("vit_config") or {})
    for old, new in (
        ("image_default_input_size", "image_size"),
        ("image_patch_size", "patch_size"),
        ("image_num_pos", "num_position_embeddings"),
    ):
        if old in vision:
            vision[new] = vision.pop(old)
    adapter = dict(config.get("adapter_config") or {})
    if "vit_layers" in adapter:
        adapter["vision_feature_layer"] = adapter.pop("vit_layers")
    return vision, adapter


def from_hf_dir(path: Path, text_hidden: int) -> Molmo2Vision:
    """The image encoder of a Molmo 2 Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Molmo 2 folder with a vision_config")
    vision, adapter = _configs(config)
    text = config.get("text_config") or {}
    args = molmo2_vision.EncoderArgs.from_configs(vision, adapter, text.get("hidden_size", 0))
    kept = max(args.feature_layers) + 1  # layers past the last one read are never run
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            if not name.startswith(_PREFIXES):
                continue
            for pattern, new in _RENAMES:
                name = re.sub(pattern, new, name)
            layer = _LAYER.match(name)
            if layer is None or int(layer.group(1)) < kept:
                weights[name] = tensor
    encoder = with_weights(
        molmo2_vision.ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden)
    )
    settings = _processor_settings(path, args)
    return Molmo2Vision(encoder, **settings, patch_id=config.get("image_patch_id", 151938))


def _pair(value: Any, source: Path, key: str) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ModelFormatError(f"{source}: {key} is {value!r}, not two counts")
    return int(value[0]), int(value[1])


def _processor_settings(path: Path, args: molmo2_vision.EncoderArgs) -> dict[str, Any]:
    """The image processor's cropping and normalization and the processor's token layout,
    else Molmo2ImageProcessor's and Molmo2Processor's defaults; a crop's patches must be
    the tower's positions (they are not interpolated)."""
    source, settings = image_processor(path)
    size = settings.get("size", {"height": 378, "width": 378})
    crop = size.get("height") if isinstance(size, dict) else None
    patch = settings.get("patch_size", 14)
    if not positive_int(crop) or size.get("width") != crop:
        raise ModelFormatError(f"{source}: size is {size!r}, not a square crop")
    if patch != args.patch_size or (crop // patch) ** 2 != args.num_position_embeddings:
        raise ModelFormatError(
            f"{source}: {crop}-pixel crops of {patch!r}-pixel patches do not fit the vision "
            f"tower's {args.num_position_embeddings} positions of {args.patch_size}-pixel patches"
        )
    max_crops = settings.get("max_crops", 8)
    if not positive_int(max_crops):
        raise ModelFormatError(f"{source}: max_crops is {max_crops!r}, not a positive integer")
    margins = _pair(settings.get("overlap_margins", [4, 4]), source, "overlap_margins")
    if sum(margins) >= crop // patch:
        raise ModelFormatError(f"{source}: overlap_margins {list(margins)} leave no window")
    pooling = _pair(settings.get("pooling_size", [2, 2]), source, "pooling_size")
    if 0 in pooling:
        raise ModelFormatError(f"{source}: pooling_size {list(pooling)} has a zero")
    if settings.get("resample", BILINEAR) != BILINEAR:
        raise ModelFormatError(
            f"{source}: resample is {settings['resample']!r}; llmrun resizes Molmo 2's images "
            "bilinearly (2), as its processor does"
        )
    layout = _layout(path)
    return dict(
        crop=crop,
        patch=patch,
        max_crops=max_crops,
        margins=margins,
        pooling=pooling,
        mean=three_floats(settings.get("image_mean", HALF), source, "image_mean"),
        std=three_floats(settings.get("image_std", HALF), source, "image_std"),
        **layout,
    )


def _layout(path: Path) -> dict[str, bool]:
    """Molmo2Processor's image layout flags from processor_config.json, else its
    defaults."""
    file = path / "processor_config.json"
    config = safetensors_io.read_json(file) if file.is_file() else {}
    columns = config.get("image_use_col_tokens", True)
    low_res = config.get("use_single_crop_col_tokens")
    start = config.get("use_single_crop_start_token", True)
    return dict(
        columns=bool(columns),
        low_res_columns=bool(columns if low_res is None else low_res),
        low_res_start=bool(start),
    )
