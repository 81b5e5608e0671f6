"""MiniCPM-V 4.6's image encoder (SigLIP tower, window merger, merger) from either format:
its Hugging Face folder (MiniCPMV4_6ForConditionalGeneration, whose preprocessor_config.json
says how images are resized and sliced), or the mmproj GGUF that llama.cpp's converter
writes beside the text model's GGUF (conversion/minicpm.py MiniCPMV4_6VisionModel:
projector type minicpmv4_6, the image processor's scale_resolution as the tower's
image_size, the window merger's layer as wa_layer_indexes, 4 (16x) or 2 (4x) as the
projector's scale factor). Both give the encoder HF's weights; the language model
(Qwen3.5) loads as for text.

MiniCPM-V 4.7's folder (MiniCPMV4_7ForConditionalGeneration) holds 4.6's encoder and image
processor; its config.json adds the ids of the markers that its canvas M-RoPE pins
(llmrun.minicpmv_canvas). llama.cpp has no converter for it: no mmproj.

MiniCPM-OCR's folder (MiniCPMOcrForConditionalGeneration, model_type minicpm_ocr) is 4.6's
model under other defaults: downsample_mode 4x where config.json gives none, and an image
processor whose default small_image_upsize ("always") resizes as 4.6's does. llama.cpp has
no converter for it either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    image_processor,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    prefixed_weights,
    projector_type,
    three_floats,
    with_suffixes,
    with_weights,
)
from llmrun.minicpmv_canvas import Markers
from llmrun.models import minicpmv_vision, siglip

MODEL_TYPE = "minicpmv4_6"
MODEL_TYPE_4_7 = "minicpmv4_7"
MODEL_TYPE_OCR = "minicpm_ocr"
# MiniCPMV4_7Config's fields -> Markers'.
_MARKER_FIELDS = {
    "image_start_id": "image_start",
    "image_end_id": "image_end",
    "slice_start_id": "slice_start",
    "slice_end_id": "slice_end",
    "newline_id": "newline",
}
# clip-impl.h's PROJECTOR_TYPE_MINICPMV4_6 (newer than the gguf package here).
PROJECTOR_TYPE = "minicpmv4_6"
# MiniCPMV4_6ImageProcessorPil's defaults (and llama.cpp's fixed slice limit).
DEFAULT_SCALE_RESOLUTION = 448
DEFAULT_MAX_SLICES = 9
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor_config.json numbers it
_HF_PREFIXES = {"model.vision_tower.": "vision_tower.", "model.merger.": "merger."}
# The GGUF module names (clip-impl.h's TN_*) -> the encoder's; the layers' are SigLIP's.
_GGUF_MODULES = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "v.vit_merger.ln1": "vision_tower.vit_merger.layer_norm1",
    "v.vit_merger.attn_q": "vision_tower.vit_merger.self_attn.q_proj",
    "v.vit_merger.attn_k": "vision_tower.vit_merger.self_attn.k_proj",
    "v.vit_merger.attn_v": "vision_tower.vit_merger.self_attn.v_proj",
    "v.vit_merger.attn_out": "vision_tower.vit_merger.self_attn.out_proj",
    "v.vit_merger.ds_ln": "vision_tower.vit_merger.pre_norm",
    "v.vit_merger.ds_ffn_up": "vision_tower.vit_merger.linear_1",
    "v.vit_merger.ds_ffn_down": "vision_tower.vit_merger.linear_2",
    "mm.input_norm": "merger.mlp.0.pre_norm",
    "mm.up": "merger.mlp.0.linear_1",
    "mm.down": "merger.mlp.0.linear_2",
}
_GGUF_NAMES = with_suffixes(_GGUF_MODULES)


@dataclass
class MiniCPMVVision:
    """A loaded MiniCPM-V 4.6 image encoder and how images are prepared for it: the whole
    image resized to about scale_resolution² pixels, and where it is larger, also cut into
    up to max_slices slices of about that size (`slicing`); resampled by Pillow filter
    `resample`, normalized by mean and std; each image's prompt led by its number in the
    message (<image_id>N</image_id>) where `image_ids`."""

    encoder: minicpmv_vision.ImageEncoder
    scale_resolution: int
    max_slices: int
    slicing: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_ids: bool = True
    resample: int = BICUBIC

    @property
    def unit(self) -> int:
        """The pixels a tile's sides are multiples of: one soft token's square."""
        return self.encoder.args.vision.patch_size * self.encoder.args.merge


@dataclass
class MiniCPMV47Vision(MiniCPMVVision):
    """A loaded MiniCPM-V 4.7 image encoder (4.6's, its images prepared alike) and the
    markers whose places its prompts' canvas M-RoPE pins."""

    markers: Markers | None = None


class MiniCPMOcrVision(MiniCPMVVision):
    """A loaded MiniCPM-OCR image encoder (4.6's, its images prepared alike)."""


def has_vision(config: dict[str, Any], model_type: str = MODEL_TYPE) -> bool:
    """Whether a Hugging Face config.json is a MiniCPM-V 4.6's (or `model_type`'s) with its
    vision tower."""
    return config.get("model_type") == model_type and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path, model_type: str = MODEL_TYPE) -> bool:
    """Whether `path` is a Hugging Face folder of a MiniCPM-V 4.6 (or `model_type`)."""
    config = path / "config.json"
    return (
        path.is_dir()
        and config.is_file()
        and has_vision(safetensors_io.read_json(config), model_type)
    )


def folder_has_vision_4_7(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a MiniCPM-V 4.7."""
    return folder_has_vision(path, MODEL_TYPE_4_7)


def folder_has_vision_ocr(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a MiniCPM-OCR."""
    return folder_has_vision(path, MODEL_TYPE_OCR)


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no MiniCPM-V 4.7 or MiniCPM-OCR mmproj: never one of theirs."""
    return False


def from_mmproj_4_7(path: str | Path, text_hidden: int) -> MiniCPMV47Vision:
    """Refused: there is no MiniCPM-V 4.7 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no MiniCPM-V 4.7 projector; give its folder")


def from_mmproj_ocr(path: str | Path, text_hidden: int) -> MiniCPMOcrVision:
    """Refused: there is no MiniCPM-OCR mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no MiniCPM-OCR projector; give its folder")


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type minicpmv4_6 (read_gguf's checks)."""
    return projector_type(path) == PROJECTOR_TYPE


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen3.5's (dense), MiniCPM-V 4.6's."""
    return config.get("model_type") in ("qwen3_5", "qwen3_5_text")


def from_hf_dir(path: Path, text_hidden: int) -> MiniCPMVVision:
    """The image encoder of a MiniCPM-V 4.6 Hugging Face folder (f32, on the CPU)."""
    return _from_hf_dir(path, text_hidden, MODEL_TYPE, "4.6")


def from_hf_dir_4_7(path: Path, text_hidden: int) -> MiniCPMV47Vision:
    """The image encoder of a MiniCPM-V 4.7 Hugging Face folder (f32, on the CPU), with
    its config.json's marker ids."""
    return _from_hf_dir(path, text_hidden, MODEL_TYPE_4_7, "4.7")


def from_hf_dir_ocr(path: Path, text_hidden: int) -> MiniCPMOcrVision:
    """The image encoder of a MiniCPM-OCR Hugging Face folder (f32, on the CPU)."""
    return _from_hf_dir(path, text_hidden, MODEL_TYPE_OCR, "OCR")


def _markers(config: dict[str, Any], path: Path) -> Markers:
    """The marker ids of a MiniCPM-V 4.7 config.json, which its images need."""
    ids = {name: config.get(key) for key, name in _MARKER_FIELDS.items()}
    missing = [
        key
        for key, name in _MARKER_FIELDS.items()
        if not isinstance(ids[name], int) or isinstance(ids[name], bool) or ids[name] < 0
    ]
    if missing:
        raise ModelFormatError(
            f"{path / 'config.json'}: no token id {', '.join(missing)}, which MiniCPM-V 4.7's "
            "images need"
        )
    return Markers(**ids)


def _from_hf_dir(path: Path, text_hidden: int, model_type: str, version: str) -> Any:
    config = safetensors_io.read_config(path)
    if not has_vision(config, model_type):
        raise UsageError(f"{path}: not a MiniCPM-V {version} folder with a vision_config")
    if model_type == MODEL_TYPE_OCR:  # MiniCPMOcrConfig's default
        config = {**config, "downsample_mode": config.get("downsample_mode") or "4x"}
    args = minicpmv_vision.EncoderArgs.from_config(config)
    weights = prefixed_weights(path, _HF_PREFIXES)
    if not args.window_merge:  # 4x: the checkpoint's window merger goes unused
        weights = {k: v for k, v in weights.items() if ".vit_merger." not in k}
    settings = _processor_settings(path, config, args)
    if model_type == MODEL_TYPE_4_7:
        settings["markers"] = _markers(config, path)
    kind = MiniCPMOcrVision if model_type == MODEL_TYPE_OCR else None
    return _build(args, weights, text_hidden, path, kind, **settings)


def _processor_settings(
    path: Path, config: dict[str, Any], args: minicpmv_vision.EncoderArgs
) -> dict[str, Any]:
    """The image processor's resizing, slicing and normalization, else
    MiniCPMV4_6ImageProcessorPil's defaults; its patch size and downsample mode must be
    the model's."""
    file, processor = image_processor(path)
    patch = args.vision.patch_size
    mode = config.get("downsample_mode") or "16x"
    for key, value in (("patch_size", patch), ("downsample_mode", mode)):
        if processor.get(key, value) != value:
            raise ModelFormatError(
                f"{file}: {key} is {processor[key]!r}, but the model's is {value!r}"
            )
    if not processor.get("do_resize", True):
        raise UnsupportedError(f"{file}: do_resize is false; llmrun resizes MiniCPM-V's images")
    upsize = processor.get("small_image_upsize", "always")  # MiniCPM-OCR's processor's
    if upsize != "always":
        raise UnsupportedError(
            f"{file}: small_image_upsize is {upsize!r}; llmrun resizes small images as "
            '"always" does'
        )
    resample = processor.get("resample", BICUBIC)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter (0..5)")
    numbers = {}
    for key, default in (
        ("scale_resolution", DEFAULT_SCALE_RESOLUTION),
        ("max_slice_nums", DEFAULT_MAX_SLICES),
    ):
        value = processor.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFormatError(f"{file}: {key} is {value!r}, not a positive integer")
        numbers[key] = value
    return dict(
        scale_resolution=numbers["scale_resolution"],
        max_slices=numbers["max_slice_nums"],
        slicing=bool(processor.get("slice_mode", True)),
        mean=three_floats(processor.get("image_mean", DEFAULT_MEAN_STD), file, "image_mean"),
        std=three_floats(processor.get("image_std", DEFAULT_MEAN_STD), file, "image_std"),
        image_ids=bool(processor.get("use_image_id", True)),
        resample=resample,
    )


def from_mmproj(path: str | Path, text_hidden: int) -> MiniCPMVVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type minicpmv4_6). Its
    image_size is the slices' scale resolution; the position table's side is that of
    v.position_embd (llama.cpp fixes it at 70, the Hub model's); images are sliced into at
    most 9, normalized by the file's mean and std, each led by its number, as
    MiniCPMV4_6Processor's defaults say."""
    gg, need = open_mmproj(path, PROJECTOR_TYPE)
    meta = gg.metadata
    vision = Keys.ClipVision

    positions = gg.tensors.get("v.position_embd.weight")
    side = math.isqrt(positions.shape[0]) if positions is not None else 0
    if positions is None or side * side != positions.shape[0]:
        raise ModelFormatError(f"{gg.path}: no square table of positions v.position_embd")
    scale = need(vision.Projector.SCALE_FACTOR, 4)
    if scale not in (2, 4):
        raise ModelFormatError(f"{gg.path}: projector scale factor {scale}, not 2 (4x) or 4 (16x)")
    inserted = meta.get(vision.WA_LAYER_INDEXES, [6])
    if not isinstance(inserted, list) or len(inserted) != 1 or not isinstance(inserted[0], int):
        raise ModelFormatError(f"{gg.path}: metadata {vision.WA_LAYER_INDEXES!r} is {inserted!r}")
    patch = need(vision.PATCH_SIZE)
    args = minicpmv_vision.EncoderArgs(
        siglip.VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=need(vision.BLOCK_COUNT),
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=side * patch,
            patch_size=patch,
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden_size=need(vision.PROJECTION_DIM),
        insert_layer_id=inserted[0],
        window_merge=scale == 4,
    )
    weights = mmproj_tensors(gg, _gguf_name, "MiniCPM-V 4.6's image encoder")
    mean, std = (
        three_floats(meta.get(key, DEFAULT_MEAN_STD), gg.path, key)
        for key in (vision.IMAGE_MEAN, vision.IMAGE_STD)
    )
    return _build(
        args,
        weights,
        text_hidden,
        gg.path,
        scale_resolution=need(vision.IMAGE_SIZE),
        max_slices=DEFAULT_MAX_SLICES,
        slicing=True,
        mean=mean,
        std=std,
    )


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, "vision_tower.encoder.layers.")


def _build(
    args: minicpmv_vision.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    kind: type | None = None,
    **settings: Any,
) -> MiniCPMVVision:
    """The encoder with `weights` (checked against its shapes), in f32, as a `kind` (by
    default 4.7's where `settings` hold markers, else 4.6's)."""
    encoder = with_weights(
        minicpmv_vision.ImageEncoder,
        args,
        weights,
        source,
        (args.text_hidden_size, text_hidden),
    )
    if kind is None:
        kind = MiniCPMV47Vision if "markers" in settings else MiniCPMVVision
    return kind(encoder, **settings)
