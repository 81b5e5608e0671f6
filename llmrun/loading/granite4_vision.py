"""Granite 4 Vision's image encoder (llmrun.models.granite4_vision) from either format: the
Hugging Face folder of a Granite4VisionForConditionalGeneration (as the Hub or transformers
5 saves it) with LlavaNextImageProcessor's preprocessor_config.json, or the mmproj GGUF
that llama.cpp's converter writes (conversion/granite.py Granite4VisionMmprojModel:
projector type granite4_vision, the SigLIP tower as v.*, projector K, in the order of the
decoder layers they go to, as v.proj_blk.K.*, each one's tower layer in
clip.vision.feature_layer and its corner or -1 in clip.vision.projector.spatial_offsets,
the pinpoints as width, height). Both give the encoder HF's weights.

A file's feature layer v is the output of the tower's layer v (clip.cpp's
granite4-vision.cpp), transformers' hidden_states[v + 1]; the converter writes a config's
negative vision layers as such, its positive ones one layer deeper than transformers reads
them. The decoder layers of the streams are the text GGUF's (llmrun.loading.granite).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.llava_vision import LlavaVision, _pinpoints, _processor_settings
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models import siglip
from llmrun.models.granite4_vision import (
    CORNERS,
    EncoderArgs,
    ImageEncoder,
    Stream,
    streams,
    whole,
)

MODEL_TYPE = "granite4_vision"
PROJECTOR = "granite4_vision"  # clip.projector_type
# clip-impl.h's keys, which this gguf package does not name.
FEATURE_LAYERS = "clip.vision.feature_layer"
SPATIAL_OFFSETS = "clip.vision.projector.spatial_offsets"
QUERY_SIDE = "clip.vision.projector.query_side"
WINDOW_SIDE = "clip.vision.projector.window_side"
GRID_PINPOINTS = "clip.vision.image_grid_pinpoints"
_TOWER = "vision_tower.vision_model."
_GGUF_NAMES = {
    "v.patch_embd.weight": _TOWER + "embeddings.patch_embedding.weight",
    "v.patch_embd.bias": _TOWER + "embeddings.patch_embedding.bias",
    "v.position_embd.weight": _TOWER + "embeddings.position_embedding.weight",
    "v.post_ln.weight": _TOWER + "post_layernorm.weight",
    "v.post_ln.bias": _TOWER + "post_layernorm.bias",
    "v.image_newline": "image_newline",
}
# A projector block's tensors (v.proj_blk.K.<name>) -> the WindowQFormer's.
_LAYER = "qformer.encoder.layer.0."
_PROJECTOR_PARAMETERS = {"query": "query", "img_pos": "image_positions"}
_PROJECTOR_MODULES = {
    "norm": "norm",
    "post_norm": "qformer.layernorm",
    "linear": "out_linear",
    **{
        f"{kind}_{part}": f"{_LAYER}{module}.{target}"
        for kind, module in (("self_attn", "attention"), ("cross_attn", "crossattention"))
        for part, target in (
            ("q", "attention.query"),
            ("k", "attention.key"),
            ("v", "attention.value"),
            ("out", "output.dense"),
            ("norm", "output.LayerNorm"),
        )
    },
    "ffn_up": _LAYER + "intermediate_query.dense",
    "ffn_down": _LAYER + "output_query.dense",
    "ffn_norm": _LAYER + "output_query.LayerNorm",
}
# Checkpoint key prefixes -> the encoder's (the Hub's vision_model level, or transformers 5's
# without it); the tower's unused head is left out.
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.vision_model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.layerwise_projectors.": "layerwise_projectors.",
    "model.spatial_projectors.": "spatial_projectors.",
    "model.image_newline": "image_newline",
}


@dataclass
class Granite4Vision(LlavaVision):
    """The encoder and LLaVA-NeXT's image processing settings (its tiles and pinpoints)."""


def folder_has_vision(path: Path) -> bool:
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Granite 4 Vision's."""
    return projector_type(path) == PROJECTOR


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "granite4_vision_text" and bool(config.get("image_layers"))


def _args(config: dict[str, Any], path: Path) -> EncoderArgs:
    if config.get("vision_feature_select_strategy", "default") != "full":
        raise UnsupportedError(
            f"{path}: vision_feature_select_strategy "
            f"{config.get('vision_feature_select_strategy', 'default')!r}: a SigLIP tower has "
            "no class token to drop; Granite 4 Vision's is 'full'"
        )
    vision = dict(config["vision_config"])
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise UnsupportedError(f"{path}: a {vision.get('model_type')} tower; llmrun runs SigLIP")
    qformer = config.get("qformer_config") or {}
    if qformer.get("num_hidden_layers", 1) != 1 or qformer.get("cross_attention_frequency", 1) != 1:
        raise UnsupportedError(
            f"{path}: a Q-Former of {qformer.get('num_hidden_layers')} layers; llmrun runs "
            "one layer with cross-attention, as Granite 4 Vision's"
        )
    parts = str(config.get("downsample_rate")).split("/")
    if len(parts) != 2 or not all(p.isdigit() and int(p) for p in parts):
        raise ModelFormatError(
            f"{path}: downsample_rate {config.get('downsample_rate')!r} is not a fraction q/w"
        )
    try:  # the model's checks name no file
        return EncoderArgs(
            vision=siglip.VisionArgs.from_config(vision),
            text_hidden=whole((config.get("text_config") or {}).get("hidden_size"), "text width"),
            query_side=int(parts[0]),
            window_side=int(parts[1]),
            qformer_intermediate=whole(
                qformer.get("intermediate_size", 3072), "Q-Former intermediate_size"
            ),
            streams=streams(config),
        )
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None


def from_hf_dir(path: Path, text_hidden: int) -> Granite4Vision:
    """Granite 4 Vision's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a Granite 4 Vision folder with a vision_config")
    args = _args(config, path)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            for old, new in _HF_PREFIXES.items():
                if name.startswith(old):
                    if ".head." not in name:
                        weights[new + name[len(old) :]] = tensor
                    break
    settings = _processor_settings(path, args.vision.image_size, next_=True)
    settings["pinpoints"] = _pinpoints(
        config.get("image_grid_pinpoints"), path / "config.json", settings["tile"]
    )
    encoder = with_weights(ImageEncoder, args, weights, path, (args.text_hidden, text_hidden))
    return Granite4Vision(encoder, **settings)


def from_mmproj(path: str | Path, text_hidden: int) -> Granite4Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type granite4_vision)."""
    gg, need = open_mmproj(path, PROJECTOR)
    meta = gg.metadata
    vision = Keys.ClipVision
    layers = need(vision.BLOCK_COUNT)
    feature_layers = meta.get(FEATURE_LAYERS)
    offsets = meta.get(SPATIAL_OFFSETS)
    ok = (
        isinstance(feature_layers, list)
        and isinstance(offsets, list)
        and len(feature_layers) == len(offsets) > 0
        and all(isinstance(v, int) and 0 <= v < layers for v in feature_layers)
        and all(isinstance(c, int) and -1 <= c < len(CORNERS) for c in offsets)
    )
    if not ok:
        raise ModelFormatError(
            f"{gg.path}: {FEATURE_LAYERS} {feature_layers!r} and {SPATIAL_OFFSETS} "
            f"{offsets!r} do not name one tower layer and corner (or -1) a projector"
        )
    # Stream k is the file's projector k (ordered by decoder layer, which the text GGUF
    # names); tower layer v's output is transformers' hidden_states[v + 1].
    streams, layerwise = [], 0
    for k, (v, corner) in enumerate(zip(feature_layers, offsets, strict=True)):
        if corner < 0:
            streams.append(Stream("layerwise", layerwise, v + 1, None, k))
            layerwise += 1
        else:
            streams.append(Stream("spatial", corner, v + 1, corner, k))
    up = gg.tensors.get("v.proj_blk.0.ffn_up.weight")
    projection = gg.tensors.get("v.proj_blk.0.linear.weight")
    if up is None or projection is None:
        raise ModelFormatError(f"{gg.path}: no v.proj_blk.0.ffn_up / linear weights")
    args = EncoderArgs(
        vision=siglip.VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=layers,
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden=projection.shape[0],  # [text hidden, vision hidden], as torch's
        query_side=need(QUERY_SIDE),
        window_side=need(WINDOW_SIDE),
        qformer_intermediate=up.shape[0],
        streams=tuple(streams),
    )
    weights = mmproj_tensors(gg, lambda name: _gguf_name(name, args), "Granite 4 Vision's encoder")
    size = args.vision.image_size
    # The converter writes each pinpoint (height, width) as width, height.
    flat = meta.get(GRID_PINPOINTS)
    if isinstance(flat, list) and len(flat) % 2 == 0:
        flat = [value for i in range(0, len(flat), 2) for value in (flat[i + 1], flat[i])]
    encoder = with_weights(ImageEncoder, args, weights, gg.path, (args.text_hidden, text_hidden))
    return Granite4Vision(
        encoder,
        size=size,
        crop=(size, size),
        pad=False,
        mean=three_floats(meta.get(vision.IMAGE_MEAN), gg.path, vision.IMAGE_MEAN),
        std=three_floats(meta.get(vision.IMAGE_STD), gg.path, vision.IMAGE_STD),
        pinpoints=_pinpoints(flat, gg.path, size),
        tile=size,
        base=(size, size),
    )


def _gguf_name(name: str, args: EncoderArgs) -> str | None:
    """An mmproj tensor's name in the encoder: the tower's as SigLIP's (vision.py's), the
    projector blocks' v.proj_blk.K.* as stream K's projector's."""
    parts = name.split(".")
    if parts[:2] != ["v", "proj_blk"] or len(parts) < 4 or not parts[2].isdigit():
        return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, _TOWER + "encoder.layers.")
    index = int(parts[2])
    if index >= len(args.streams):
        return None
    stream = args.streams[index]
    rest = ".".join(parts[3:])
    module, _, suffix = rest.rpartition(".")
    if rest in _PROJECTOR_PARAMETERS:
        local = _PROJECTOR_PARAMETERS[rest]
    elif module in _PROJECTOR_MODULES and suffix in ("weight", "bias"):
        local = f"{_PROJECTOR_MODULES[module]}.{suffix}"
    else:
        return None
    return f"{stream.kind}_projectors.{stream.index}.{local}"
