"""Mistral 3's image encoder (Pixtral's tower, Mistral 3's projector) from either format:
its Hugging Face folder (Mistral3ForConditionalGeneration), or the mmproj GGUF that
llama.cpp's converter writes beside the text model's GGUF (conversion/llava.py: projector
type pixtral, q/k rows permuted as Llama's), or Mistral's native folder (params.json's
vision_encoder, consolidated*.safetensors: the names transformers' convert_mistral3_weights_to_hf
and llama.cpp's `--mistral-format --mmproj` read, q/k rows interleaved as GGUF's). Mistral
Large 4's Hugging Face folders (MistralLarge4ForConditionalGeneration) hold the same tower
and projector under those native names. All give the encoder HF's weights.

llama.cpp splices an [IMG_BREAK] embedding after each row of an image's tokens, from the
mmproj's v.token_embd.img_break (a copy of the language model's row, which today's
converter leaves out of mmproj files made from a Hugging Face folder). llmrun embeds
[IMG_BREAK] by the language model's own row, as transformers does (llmrun.pixtral_images).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, mistral_native, safetensors_io, vl_text
from llmrun.loading.vision import (
    encoder_tensor,
    mmproj_name,
    open_mmproj,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models import pixtral

MODEL_TYPE = "mistral3"
# The model types whose folders hold Mistral 3's tower and projector: Mistral Large 4's too.
MODEL_TYPES = (MODEL_TYPE, "mistral_large4")
# PixtralImageProcessor's mean and std per channel (CLIP's).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Checkpoint key prefixes of the vision parts (the Hub's, transformers 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# The GGUF names of a layer's tensors (gguf-py's tensor_mapping) -> Pixtral's.
_GGUF_LAYER = {
    "ln1": "attention_norm",
    "attn_q": "attention.q_proj",
    "attn_k": "attention.k_proj",
    "attn_v": "attention.v_proj",
    "attn_out": "attention.o_proj",
    "ln2": "ffn_norm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
_GGUF_NAMES = {
    "v.patch_embd.weight": "vision_tower.patch_conv.weight",
    "v.pre_ln.weight": "vision_tower.ln_pre.weight",
    "mm.input_norm.weight": "multi_modal_projector.norm.weight",
    "mm.patch_merger.weight": "multi_modal_projector.patch_merger.merging_layer.weight",
    "mm.1.weight": "multi_modal_projector.linear_1.weight",
    "mm.1.bias": "multi_modal_projector.linear_1.bias",
    "mm.2.weight": "multi_modal_projector.linear_2.weight",
    "mm.2.bias": "multi_modal_projector.linear_2.bias",
}
# The language model's [IMG_BREAK] row, which it embeds itself.
_IMAGE_BREAK = "v.token_embd.img_break"
# A native folder's tensor names (mistral-inference's) -> the encoder's; a layer's below.
_NATIVE_NAMES = {
    "vision_encoder.patch_conv.weight": "vision_tower.patch_conv.weight",
    "vision_encoder.ln_pre.weight": "vision_tower.ln_pre.weight",
    "pre_mm_projector_norm.weight": "multi_modal_projector.norm.weight",
    "patch_merger.merging_layer.weight": "multi_modal_projector.patch_merger.merging_layer.weight",
    "vision_language_adapter.w_in.weight": "multi_modal_projector.linear_1.weight",
    "vision_language_adapter.w_in.bias": "multi_modal_projector.linear_1.bias",
    "vision_language_adapter.w_out.weight": "multi_modal_projector.linear_2.weight",
    "vision_language_adapter.w_out.bias": "multi_modal_projector.linear_2.bias",
}
_NATIVE_LAYER = {
    "attention.wq": "attention.q_proj",
    "attention.wk": "attention.k_proj",
    "attention.wv": "attention.v_proj",
    "attention.wo": "attention.o_proj",
    "attention_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
    "feed_forward.w1": "feed_forward.gate_proj",
    "feed_forward.w2": "feed_forward.down_proj",
    "feed_forward.w3": "feed_forward.up_proj",
}
_NATIVE_LAYER_RE = re.compile(r"vision_encoder\.transformer\.layers\.(\d+)\.(.+)\.weight")


@dataclass
class PixtralVision:
    """A loaded Mistral 3 image encoder and how images are prepared for it: resized to
    fit `longest_edge` in sides of encoder.args.unit pixels, normalized by mean and std."""

    encoder: pixtral.ImageEncoder
    longest_edge: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Mistral 3 (or Mistral Large 4) with
    its vision tower (not LightOnOCR's older files, which say mistral3 too:
    llmrun.loading.lighton_ocr_vision)."""
    vision = config.get("vision_config")
    architectures = config.get("architectures") or [None]
    lighton = architectures[0] == vl_text.LIGHTONOCR_ARCHITECTURE
    return config.get("model_type") in MODEL_TYPES and isinstance(vision, dict) and not lighton


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Mistral 3 with its vision tower, or a
    native folder whose params.json has Mistral 3's (a vision_encoder with the patch merger:
    check_native_tower refuses Pixtral 12B's)."""
    if not path.is_dir():
        return False
    config = path / "config.json"
    if config.is_file():
        return has_vision(safetensors_io.read_json(config))
    if not (path / mistral_native.PARAMS).is_file():
        return False
    vision = mistral_native.read_params(path).get("vision_encoder")
    return isinstance(vision, dict) and vision.get("mm_projector_id") == "patch_merge"


def check_native_tower(path: Path) -> None:
    """Refuse images for a native folder whose vision_encoder is not Mistral 3's, saying
    why (Pixtral 12B's, without the patch merger); any other folder passes."""
    params = path / mistral_native.PARAMS
    if path.is_dir() and not (path / "config.json").is_file() and params.is_file():
        native = mistral_native.read_params(path)
        if isinstance(native.get("vision_encoder"), dict):
            native_config(native, params)


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type pixtral (read_gguf's checks)."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    kind = meta.get(Keys.Clip.PROJECTOR_TYPE, meta.get(Keys.ClipVision.PROJECTOR_TYPE))
    return kind == VisionProjectorType.PIXTRAL


def from_hf_dir(path: Path, text_hidden: int) -> PixtralVision:
    """Mistral 3's image encoder from its Hugging Face folder, or its native folder (f32,
    on the CPU)."""
    if not (path / "config.json").is_file() and (path / mistral_native.PARAMS).is_file():
        return from_native_dir(path, text_hidden)
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Mistral 3 folder with a vision_config")
    args = pixtral.EncoderArgs.from_config(config)
    weights = prefixed_weights(path, _HF_PREFIXES)
    if not weights:  # Mistral Large 4's files: the native names (transformers saves them so)
        files = [f.name for f in safetensors_io.safetensors_files(path)]
        weights = _native_weights(path, files, args.vision.num_attention_heads)
    longest_edge, mean, std = _processor_settings(path, args.vision.image_size)
    return _build(args, weights, text_hidden, path, longest_edge, mean, std)


def from_native_dir(path: Path, text_hidden: int) -> PixtralVision:
    """Mistral 3's image encoder from a native folder: params.json's vision_encoder (with
    the patch merger, mm_projector_id "patch_merge") and the consolidated files' vision
    tensors; images fit its image_size, normalized by CLIP's mean and std (mistral_common's,
    which llama.cpp's converter writes for such a folder)."""
    where = path / mistral_native.PARAMS
    params = mistral_native.read_params(path)
    args = pixtral.EncoderArgs.from_config(native_config(params, where))
    files = mistral_native.weight_files((p.name for p in path.iterdir()), path)
    weights = _native_weights(path, files, args.vision.num_attention_heads)
    return _build(args, weights, text_hidden, path, args.vision.image_size, CLIP_MEAN, CLIP_STD)


def _native_weights(path: Path, files: list[str], heads: int) -> dict[str, torch.Tensor]:
    """The vision tensors of `files` in `path` under their native names (mistral-inference's),
    as the encoder's, q/k rows un-interleaved (`heads` heads)."""
    weights = {}
    for file in files:
        for name, tensor in safetensors_io.load_tensors(path / file).items():
            if name.startswith(mistral_native.VISION_PREFIXES):
                weights[_native_name(name, path)] = tensor
    for name, tensor in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            try:
                weights[name] = gguf_io.unpermute_rows(tensor, heads)
            except ModelFormatError as e:
                raise ModelFormatError(f"{path}: {name}: {e}") from None
    return weights


def native_config(params: dict[str, Any], where: Path) -> dict[str, Any]:
    """A native params.json as the Mistral3Config of the same model's image parts, as
    transformers' convert_mistral3_weights_to_hf writes it (the tower's activation SiLU,
    llama.cpp's for such a folder; the projector's norm eps the text model's norm_eps)."""
    vision = params.get("vision_encoder")
    if not isinstance(vision, dict):
        raise UsageError(f"{where}: no vision_encoder: the model takes no images")
    if vision.get("mm_projector_id") != "patch_merge":
        raise UnsupportedError(
            f"{where}: a vision_encoder without Mistral 3's patch merger (mm_projector_id "
            f"{vision.get('mm_projector_id')!r}: Pixtral 12B's); llmrun runs Mistral 3's"
        )
    if vision.get("add_pre_mm_projector_layer_norm", True) is not True:
        raise UnsupportedError(f"{where}: a vision_encoder without its pre-projector norm")
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    vision_config = {k: vision[k] for k in (*keys, "image_size", "patch_size") if k in vision}
    vision_config.update(
        num_channels=vision.get("num_channels", 3),
        rope_theta=vision.get("rope_theta", 10000.0),
        hidden_act="silu",
    )
    merge = vision.get("spatial_merge_size")
    if not isinstance(merge, int) or isinstance(merge, bool):
        raise ModelFormatError(f"{where}: vision_encoder's spatial_merge_size is {merge!r}")
    return {
        "vision_config": vision_config,
        "text_config": {"hidden_size": params["dim"], "rms_norm_eps": params["norm_eps"]},
        "spatial_merge_size": merge,
        "multimodal_projector_bias": bool(vision.get("adapter_bias", False)),
    }


def _native_name(name: str, path: Path) -> str:
    hf = _NATIVE_NAMES.get(name)
    layer = _NATIVE_LAYER_RE.fullmatch(name)
    if layer and layer.group(2) in _NATIVE_LAYER:
        into = "vision_tower.transformer.layers."
        hf = f"{into}{layer.group(1)}.{_NATIVE_LAYER[layer.group(2)]}.weight"
    if hf is None:
        raise UnsupportedError(f"{path}: tensor {name!r} is not part of Mistral 3's encoder")
    return hf


def _processor_settings(
    path: Path, image_size: int
) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """preprocessor_config.json's size.longest_edge, image_mean and image_std, else the
    vision config's image_size and CLIP's mean and std (PixtralImageProcessor's)."""
    file = path / "preprocessor_config.json"
    processor: dict[str, Any] = {}
    if file.is_file():
        try:
            processor = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    size = processor.get("size") or {}
    longest = size.get("longest_edge", image_size) if isinstance(size, dict) else None
    if not isinstance(longest, int) or isinstance(longest, bool) or longest < 1:
        raise ModelFormatError(f"{file}: size is {size!r}, not a longest_edge in pixels")
    mean = three_floats(processor.get("image_mean", CLIP_MEAN), file, "image_mean")
    std = three_floats(processor.get("image_std", CLIP_STD), file, "image_std")
    return longest, mean, std


def from_mmproj(path: str | Path, text_hidden: int) -> PixtralVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type pixtral, with
    Mistral 3's patch merger)."""
    args, weights, mean, std, gg = read_mmproj(path, VisionProjectorType.PIXTRAL, "Mistral 3")
    return _build(args, weights, text_hidden, gg.path, args.vision.image_size, mean, std)


def read_mmproj(
    path: str | Path, projector: str, family: str
) -> tuple[pixtral.EncoderArgs, dict[str, torch.Tensor], Any, Any, gguf_io.GGUFFile]:
    """The encoder's args, weights (q/k rows unpermuted), mean and std of an mmproj GGUF of
    projector type `projector` (pixtral, or lightonocr: the same tensors), with the
    patch merger `family` (as messages name it) has, and the file."""
    gg, need = open_mmproj(path, projector)
    meta = gg.metadata
    vision = Keys.ClipVision
    if "mm.patch_merger.weight" not in gg.tensors:
        raise UnsupportedError(
            f"{gg.path}: a {projector} mmproj without {family}'s patch merger (Pixtral "
            f"12B's); llmrun runs {family}'s"
        )
    act = "silu" if meta.get(vision.USE_SILU) else "gelu"
    args = pixtral.EncoderArgs(
        pixtral.VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=need(vision.BLOCK_COUNT),
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            hidden_act=act,
            # clip.cpp's for pixtral and lightonocr, whatever the file says
            rope_theta=10000.0,
        ),
        text_hidden_size=need(vision.PROJECTION_DIM),
        spatial_merge_size=need(vision.SPATIAL_MERGE_SIZE),
        multimodal_projector_bias="mm.1.bias" in gg.tensors,
        # the projector's RMSNorm takes clip.cpp's eps, the file's layer norm eps
        norm_eps=float(meta.get(vision.Attention.LAYERNORM_EPS, 1e-5)),
    )
    heads = args.vision.num_attention_heads
    weights = {}
    for info in gg.tensors.values():
        if info.name == _IMAGE_BREAK:
            continue
        name = _gguf_name(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of {family}'s encoder"
            )
        tensor = encoder_tensor(gg, info)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = gguf_io.unpermute_rows(tensor, heads)
        weights[name] = tensor
    mean = three_floats(meta.get(vision.IMAGE_MEAN, CLIP_MEAN), gg.path, vision.IMAGE_MEAN)
    std = three_floats(meta.get(vision.IMAGE_STD, CLIP_STD), gg.path, vision.IMAGE_STD)
    return args, weights, mean, std, gg


def _gguf_name(name: str) -> str | None:
    into = "vision_tower.transformer.layers."
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, into, suffixes=("weight",))


def _build(
    args: pixtral.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    longest_edge: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> PixtralVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    if longest_edge < args.unit:
        raise ModelFormatError(
            f"{source}: images fit in {longest_edge} pixels, less than a token's {args.unit}"
        )
    encoder = with_weights(
        pixtral.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return PixtralVision(encoder, longest_edge, mean, std)
