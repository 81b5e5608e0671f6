"""LLaVA's image encoder (llmrun.models.llava_vision) from either format: the Hugging Face
folder of a LlavaForConditionalGeneration or LlavaNextForConditionalGeneration (the "-hf"
repos, as the Hub or transformers 5 saves them) with its preprocessor_config.json, or of
their kin VipLlavaForConditionalGeneration (llava-hf/vip-llava-7b-hf),
VideoLlavaForConditionalGeneration (LanguageBind/Video-LLaVA-7B-hf: its image_tower; the
video_tower is not read) and LlavaNextVideoForConditionalGeneration
(llava-hf/LLaVA-NeXT-Video-7B-hf), whose images only llmrun takes; or the
mmproj GGUF that llama.cpp's LLaVA script writes (tools/mtmd/legacy-models/
convert_image_encoder_to_gguf.py: projector type mlp, CLIP's tensors as v.*, the projector
as mm.0 / mm.2, LLaVA-NeXT's image_grid_pinpoints and model.image_newline). Both give the
encoder HF's weights.

That script drops the tower's layers past the feature layer (the last one by default),
names each MLP's fc1 ffn_down and fc2 ffn_up (clip.cpp swaps them back by shape, as here),
and writes no preprocessing but the mean and std. For an mmproj, llmrun prepares a LLaVA 1.5
image as LlavaImageProcessor with do_pad (padded square with the mean colour, as the
original LLaVA 1.5 and clip.cpp do) and a LLaVA-NeXT one as LlavaNextImageProcessor, tiles
of the tower's size. clip.cpp differs (models/llava.cpp): it puts the class token after
the patches, so each patch takes its neighbour's position, and its features are that
sequence's rows 1..n (the first patch dropped, the class token kept); where the file names
no feature layer it runs one layer fewer than the file holds; and it resizes with its own
filters (benchmarks/llama_cpp_llava.py: with that order, llmrun's tokens are llama-server's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import (
    VISION_PROJECTOR_TYPE,
    VISION_PROJECTOR_TYPE_NAMES,
    Keys,
)

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models.llava_vision import NEWLINE_MODEL_TYPES, EncoderArgs, ImageEncoder, VisionArgs

MODEL_TYPES = ("llava", "llava_next", "vipllava", "video_llava", "llava_next_video")
# CLIPImageProcessor's OpenAI CLIP mean and std.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the processors' default
# Each pinpoint is a canvas an image is drawn on: refuse sizes no LLaVA uses (llava-v1.6's
# largest is 1008, LLaVA-OneVision's 2304) before allocating them.
MAX_PINPOINT_SIDE = 8192
# clip-impl.h's keys, which this gguf package does not name.
GRID_PINPOINTS = "clip.vision.image_grid_pinpoints"
FEATURE_LAYERS = "clip.vision.feature_layer"
_NEWLINES = ("model.image_newline", "v.image_newline")  # the script's, clip.cpp's today
# Checkpoint key prefixes -> the encoder's: the Hub's files (vision_tower.vision_model.,
# language_model.*), transformers 5's (model.vision_tower., no vision_model.).
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.vision_model.",
    "vision_tower.vision_model.": "vision_tower.vision_model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "vision_tower.": "vision_tower.vision_model.",
    # Video-LLaVA's image tower (its video tower is another CLIP, for videos only)
    "model.image_tower.vision_model.": "vision_tower.vision_model.",
    "image_tower.vision_model.": "vision_tower.vision_model.",
    "model.image_tower.": "vision_tower.vision_model.",
    "image_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
    "model.image_newline": "image_newline",
    "image_newline": "image_newline",
}
_TOWER = "vision_tower.vision_model."
_GGUF_NAMES = {
    "v.class_embd": _TOWER + "embeddings.class_embedding",
    "v.patch_embd.weight": _TOWER + "embeddings.patch_embedding.weight",
    "v.position_embd.weight": _TOWER + "embeddings.position_embedding.weight",
    "v.pre_ln.weight": _TOWER + "pre_layrnorm.weight",
    "v.pre_ln.bias": _TOWER + "pre_layrnorm.bias",
    "mm.0.weight": "multi_modal_projector.linear_1.weight",
    "mm.0.bias": "multi_modal_projector.linear_1.bias",
    "mm.2.weight": "multi_modal_projector.linear_2.weight",
    "mm.2.bias": "multi_modal_projector.linear_2.bias",
    **{name: "image_newline" for name in _NEWLINES},
}
MLP = VISION_PROJECTOR_TYPE_NAMES[VISION_PROJECTOR_TYPE.MLP]  # "mlp"


@dataclass
class LlavaVision:
    """A loaded LLaVA image encoder and how images are prepared for it (the image
    processor's settings): resized to `size` (the shorter side, or (height, width)) and
    centre-cropped to `crop`, after padding to a square where `pad`; for LLaVA-NeXT, the
    pinpoint resolutions, their tiles' side and the base tile's (height, width)."""

    encoder: ImageEncoder
    size: int | tuple[int, int]
    crop: tuple[int, int] | None
    pad: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BICUBIC
    pinpoints: list[tuple[int, int]] | None = None
    tile: int = 0
    base: tuple[int, int] = (0, 0)

    @property
    def image_size(self) -> int:
        return self.encoder.args.vision.image_size


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a LLaVA 1.5 / LLaVA-NeXT (or VipLLaVA, Video-LLaVA,
    LLaVA-NeXT-Video) with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is LLaVA's two-layer MLP."""
    return projector_type(path) == MLP


def from_hf_dir(path: Path, text_hidden: int) -> LlavaVision:
    """LLaVA's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a LLaVA folder with a vision_config")
    args = EncoderArgs.from_config(config)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name, args)
            if new is not None:
                weights[new] = tensor
    next_ = config["model_type"] in NEWLINE_MODEL_TYPES
    settings = _processor_settings(path, args.vision.image_size, next_)
    if next_:
        settings["pinpoints"] = _pinpoints(
            config.get("image_grid_pinpoints"), path / "config.json", settings["tile"]
        )
    return _build(args, weights, text_hidden, path, **settings)


def _hf_name(name: str, args: EncoderArgs) -> str | None:
    """The encoder's name of a checkpoint tensor; None for the language model's, the
    tower's post_layernorm and the layers past the deepest feature layer."""
    for old, new in _HF_PREFIXES.items():
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    else:
        return None
    if name.startswith(_TOWER + "post_layernorm."):
        return None
    layers = _TOWER + "encoder.layers."
    index = name[len(layers) :].split(".")[0]
    if name.startswith(layers) and index.isdigit() and int(index) >= args.layers_run:
        return None
    return name


def _processor_settings(path: Path, image_size: int, next_: bool) -> dict[str, Any]:
    """preprocessor_config.json's size, crop_size, do_center_crop, do_pad, resample,
    image_mean and image_std (CLIPImageProcessor's defaults where it has none, but of the
    tower's image size), checked to make tiles of the tower's size."""
    file = path / "preprocessor_config.json"
    processor: dict[str, Any] = {}
    if file.is_file():
        try:
            processor = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    size = _size(processor.get("size", {"shortest_edge": image_size}), file, "size")
    crop = None
    if processor.get("do_center_crop", True):
        crop = _size(
            processor.get("crop_size", {"height": image_size, "width": image_size}),
            file,
            "crop_size",
        )
        if isinstance(crop, int):
            crop = (crop, crop)
    square = crop if crop is not None else size
    if square != (image_size, image_size):
        raise ModelFormatError(
            f"{file}: its images are {square!r} pixels, but the vision tower takes "
            f"{image_size}x{image_size}"
        )
    resample = processor.get("resample", BICUBIC)
    if resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter")
    settings: dict[str, Any] = dict(
        size=size,
        crop=crop,
        # LlavaImageProcessor's square padding; CLIPImageProcessor has no do_pad, and
        # LlavaNextImageProcessor's pads a batch's tile counts.
        pad=bool(processor.get("do_pad", False))
        and str(processor.get("image_processor_type", "")).startswith("LlavaImageProcessor"),
        mean=three_floats(processor.get("image_mean", CLIP_MEAN), file, "image_mean"),
        std=three_floats(processor.get("image_std", CLIP_STD), file, "image_std"),
        resample=resample,
    )
    if next_:  # LlavaNextImageProcessor's tile side and base tile size
        settings["tile"] = crop[0] if crop is not None else size[0]
        settings["base"] = (size, size) if isinstance(size, int) else size
    return settings


def _size(value: Any, source: Path, key: str) -> int | tuple[int, int]:
    """A processor size: {"shortest_edge": n} as n, {"height": h, "width": w} as (h, w)."""
    if isinstance(value, dict):
        if set(value) == {"shortest_edge"} and positive_int(value["shortest_edge"]):
            return value["shortest_edge"]
        if set(value) == {"height", "width"} and all(positive_int(v) for v in value.values()):
            return value["height"], value["width"]
    elif positive_int(value):
        return value
    raise ModelFormatError(f"{source}: {key} is {value!r}, not a size in pixels")


def _pinpoints(value: Any, source: Path | str, tile: int) -> list[tuple[int, int]]:
    """image_grid_pinpoints as (height, width) pairs of whole tiles."""
    if isinstance(value, list) and value and all(positive_int(v) for v in value):
        if len(value) % 2 == 0:  # an mmproj's, flattened
            value = [value[i : i + 2] for i in range(0, len(value), 2)]
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(p, list | tuple) and len(p) == 2 and all(positive_int(v) for v in p)
            for p in value
        )
    )
    if not ok:
        raise ModelFormatError(f"{source}: image_grid_pinpoints is {value!r}")
    pairs = [(p[0], p[1]) for p in value]
    if max(max(p) for p in pairs) > MAX_PINPOINT_SIDE:
        raise ModelFormatError(
            f"{source}: image_grid_pinpoints {pairs} go past {MAX_PINPOINT_SIDE} pixels a side"
        )
    if any(h % tile or w % tile for h, w in pairs):
        raise ModelFormatError(
            f"{source}: image_grid_pinpoints {pairs} are not whole tiles of {tile} pixels"
        )
    return pairs


def from_mmproj(path: str | Path, text_hidden: int) -> LlavaVision:
    """The image encoder of llama.cpp's LLaVA mmproj GGUF (projector type mlp)."""
    gg, need = open_mmproj(path, MLP)
    meta = gg.metadata
    vision = Keys.ClipVision

    if meta.get(vision.USE_SILU):
        raise UnsupportedError(f"{gg.path}: a SiLU vision tower; LLaVA's CLIP is quick-GELU")
    layers = need(vision.BLOCK_COUNT)
    feature_layers = meta.get(FEATURE_LAYERS, [layers])
    if not isinstance(feature_layers, list) or len(feature_layers) != 1:
        raise UnsupportedError(
            f"{gg.path}: feature layers {feature_layers!r}; llmrun runs one, as LLaVA's"
        )
    projection = gg.tensors.get("mm.2.weight")
    if projection is None or len(projection.shape) != 2:
        raise UnsupportedError(
            f"{gg.path}: no 2-D mm.2.weight: not LLaVA's two-layer MLP projector"
        )
    pinpoints = meta.get(GRID_PINPOINTS)
    newline = any(name in gg.tensors for name in _NEWLINES)
    if (pinpoints is None) == newline:
        raise ModelFormatError(
            f"{gg.path}: LLaVA-NeXT's image_grid_pinpoints and image_newline come together"
        )
    args = EncoderArgs(
        VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=layers,
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            hidden_act="gelu" if meta.get(vision.USE_GELU) else "quick_gelu",
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        # [text hidden, text hidden] as GGUF dims, ne[1] the rows of the Linear.
        text_hidden_size=projection.shape[1],
        feature_layers=feature_layers,
        newline=newline,
    )

    def not_past_feature_layer(name: str) -> bool:
        return ".encoder.layers." not in name or int(name.split(".")[4]) < args.layers_run

    weights = mmproj_tensors(gg, _gguf_name, "LLaVA's encoder", keep=not_past_feature_layer)
    weights = _unswapped(weights, args.vision.hidden_size)
    size = args.vision.image_size
    settings: dict[str, Any] = dict(
        size=size,
        crop=(size, size),
        pad=pinpoints is None,
        mean=three_floats(meta.get(vision.IMAGE_MEAN, CLIP_MEAN), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD, CLIP_STD), gg.path, vision.IMAGE_STD),
    )
    if pinpoints is not None:
        settings.update(
            pinpoints=_pinpoints(pinpoints, gg.path, size), tile=size, base=(size, size)
        )
    return _build(args, weights, text_hidden, gg.path, **settings)


def _gguf_name(name: str) -> str | None:
    # CLIP's layers are named as SigLIP's; ffn_up is mlp.fc1 until _unswapped looks at
    # the shapes.
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, _TOWER + "encoder.layers.")


def _unswapped(weights: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """The MLPs' fc1 and fc2 where the file names them the other way round: an fc2 (named
    ffn_down) that takes the tower's width is an fc1 (clip.cpp's is_ffn_swapped)."""
    out = dict(weights)
    for name, tensor in weights.items():
        if name.endswith(".mlp.fc2.weight") and tensor.shape[-1] == hidden != tensor.shape[0]:
            for suffix in ("weight", "bias"):
                fc1, fc2 = (name.replace("fc2.weight", f"fc{i}.{suffix}") for i in (1, 2))
                if fc1 in weights and fc2 in weights:
                    out[fc1], out[fc2] = weights[fc2], weights[fc1]
    return out


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> LlavaVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(
        ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return LlavaVision(encoder, **settings)
