"""Muse Glimmer's vision tower and projector (llmrun.models.muse_glimmer_vision) from either
format: the Hugging Face folder's model.vision_tower.*, model.vision_adapter.* and
model.vision_projection.* tensors with its preprocessor_config.json, or the mmproj GGUF
that llama.cpp's converter writes (conversion/muse_glimmer.py MuseGlimmerVisionModel;
tools/mtmd/clip.cpp reads it): projector type "muse-glimmer" (a name the installed gguf
package may not know yet), q/k rows permuted per head as Llama's (undone here), the patch
embedding's two temporal slabs summed into a conv2d (as the folder's are summed here), the
adapter and projection as mm.0, mm.1 and mm.2. An mmproj says nothing of the layers'
windows, the image token cap, the RoPE base or the final norm's epsilon: clip.cpp's
(MuseGlimmerVisionConfig's and MuseGlimmerTextConfig's defaults) are taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.vision import (
    image_processor,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    prefixed_weights,
    projector_type,
    three_floats,
    with_suffixes,
    with_weights,
)
from llmrun.models.muse_glimmer_vision import EncoderArgs, VisionModel, check_square

MODEL_TYPE, TEXT_MODEL_TYPE = "muse_glimmer", "muse_glimmer_text"
# Muse Spark's tower, adapter and projection are Muse Glimmer's (MuseSparkVisionModel).
SPARK_MODEL_TYPE, SPARK_TEXT_MODEL_TYPE = "muse_spark", "muse_spark_text"
PROJECTOR = "muse-glimmer"
MEAN = STD = (0.5, 0.5, 0.5)  # MuseGlimmerImageProcessor's (IMAGENET_STANDARD_*)
MAX_IMAGE_TOKENS = 4096  # MuseGlimmerImageProcessor's, and clip.cpp's token limit
_PATCH_EMBEDDING = "patch_embedder.patch_embedding.weight"
# The q/k rows the converter permutes per head as Llama's (for ggml's adjacent-pair RoPE).
_PERMUTED = tuple(f"attn.{p}_proj.{s}" for p in "qk" for s in ("weight", "bias"))
_HF_PREFIXES = {
    "model.vision_tower.": "",
    "model.vision_adapter.": "vision_adapter.",
    "model.vision_projection.": "vision_projection.",
}
_GGUF_NAMES = {
    **with_suffixes({"v.pre_ln": "ln_pre", "v.post_ln": "ln_post"}),
    "v.patch_embd.weight": _PATCH_EMBEDDING,
    "v.position_embd.weight": "patch_embedder.position_embedding_table.weight",
    "mm.0.weight": "vision_adapter.fc1.weight",
    "mm.1.weight": "vision_adapter.fc2.weight",
    "mm.2.weight": "vision_projection.weight",
}
_GGUF_LAYER = {
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


@dataclass
class MuseGlimmerVision:
    """A loaded Muse Glimmer vision tower and how images are prepared for it
    (MuseGlimmerImageProcessor's settings)."""

    encoder: VisionModel
    mean: tuple[float, ...]
    std: tuple[float, ...]
    max_tokens: int = MAX_IMAGE_TOKENS


def has_vision(config: dict[str, Any], model_type: str = MODEL_TYPE) -> bool:
    return config.get("model_type") == model_type and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a Muse Glimmer's with its
    vision_config."""
    return has_vision(safetensors_io.read_config(path))


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == TEXT_MODEL_TYPE


def spark_folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder's config.json is a Muse Spark's with its
    vision_config."""
    return has_vision(safetensors_io.read_config(path), SPARK_MODEL_TYPE)


def spark_text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == SPARK_TEXT_MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Muse Glimmer's."""
    return projector_type(path) == PROJECTOR


def from_hf_dir(path: Path, text_hidden: int) -> MuseGlimmerVision:
    """The vision tower and projector of a Muse Glimmer folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    try:
        args = EncoderArgs.from_config(config)
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None
    weights = prefixed_weights(path, _HF_PREFIXES)
    slabs = config["vision_config"].get("patch_temporal", 2)
    stacked = weights.get(_PATCH_EMBEDDING)
    if stacked is not None and stacked.shape[-1] == slabs * 3 * args.patch_size**2:
        # [hidden, T * 3 * P²] -> [hidden, 3 * P²]: an image is the same frame T times.
        weights[_PATCH_EMBEDDING] = stacked.float().view(stacked.shape[0], slabs, -1).sum(1)
    source, settings = image_processor(path)
    for name, default in (("patch_size", args.patch_size), ("merge_size", args.merge_size)):
        if settings.get(name, default) != default:
            raise ModelFormatError(
                f"{source}: {name} {settings[name]!r}, but the vision tower's is {default}"
            )
    max_tokens = settings.get("max_image_tokens", MAX_IMAGE_TOKENS)
    if not positive_int(max_tokens):
        raise ModelFormatError(f"{source}: max_image_tokens {max_tokens!r}")
    mean = three_floats(settings.get("image_mean", MEAN), source, "image_mean")
    std = three_floats(settings.get("image_std", STD), source, "image_std")
    encoder = with_weights(VisionModel, args, weights, path, (args.out_hidden_size, text_hidden))
    return MuseGlimmerVision(encoder, mean, std, max_tokens)


def from_mmproj(path: str | Path, text_hidden: int) -> MuseGlimmerVision:
    """The vision tower and projector of llama.cpp's mmproj GGUF (projector muse-glimmer)."""
    gg, need = open_mmproj(path, PROJECTOR)
    meta, vision = gg.metadata, Keys.ClipVision
    table = gg.tensors.get("v.position_embd.weight")
    adapter = gg.tensors.get("mm.1.weight")
    if table is None or adapter is None or len(table.shape) != 2 or len(adapter.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D v.position_embd.weight and mm.1.weight")
    width = need(vision.EMBEDDING_LENGTH)
    try:
        args = EncoderArgs(
            hidden_size=width,
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=need(vision.BLOCK_COUNT),
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            projector_hidden_size=adapter.shape[0],
            out_hidden_size=need(vision.PROJECTION_DIM),
            pos_emb_side=check_square(next((d for d in table.shape if d != width), width)),
            patch_size=need(vision.PATCH_SIZE),
            merge_size=need(vision.SPATIAL_MERGE_SIZE, 2),
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS, 1e-5)),
        )
    except ModelFormatError as e:
        raise ModelFormatError(f"{gg.path}: {e}") from None
    weights = mmproj_tensors(gg, _gguf_name, "Muse Glimmer's vision tower")
    for name in list(weights):
        if name.endswith(_PERMUTED):
            try:
                weights[name] = gguf_io.unpermute_rows(weights[name], args.num_attention_heads)
            except ModelFormatError as e:
                raise ModelFormatError(f"{gg.path}: {name}: {e}") from None
    patch = weights.get(_PATCH_EMBEDDING)
    if patch is not None:
        weights[_PATCH_EMBEDDING] = patch.reshape(patch.shape[0], -1)  # conv2d -> linear
    mean = three_floats(meta.get(vision.IMAGE_MEAN, MEAN), gg.path, vision.IMAGE_MEAN)
    std = three_floats(meta.get(vision.IMAGE_STD, STD), gg.path, vision.IMAGE_STD)
    encoder = with_weights(VisionModel, args, weights, gg.path, (args.out_hidden_size, text_hidden))
    return MuseGlimmerVision(encoder, mean, std)


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, _GGUF_LAYER, "layers.")
