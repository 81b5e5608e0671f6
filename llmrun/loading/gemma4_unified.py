"""Gemma 4 Unified's image and audio embedders from either format: its Hugging Face
folder (Gemma4UnifiedForConditionalGeneration: model.vision_embedder.* and
model.embed_vision.* as the Hub saves them, model.embed_audio.*), or the mmproj GGUF that
llama.cpp's converter writes beside the text model's GGUF (conversion/gemma.py
Gemma4UnifiedVisionAudioModel: projector types gemma4uv and gemma4ua; the first
LayerNorm and the patch projection in ggml's im2col order, channel by channel, where
HF's patches are pixel by pixel; the position table as [2, positions, width]; the three
LayerNorms as v.patch_norm.1, .2, .3). Both give the embedders HF's weights.

An image takes up to the image processor's max_soft_tokens (Gemma 4's settings: the
default 280 for an mmproj, as llama.cpp's); a clip's frames are the feature extractor's
audio_samples_per_token (the audio embedder's width; llama.cpp's gemma4ua takes 640).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.gemma4_vision import DEFAULT_SOFT_TOKENS, max_soft_tokens
from llmrun.loading.vision import (
    encoder_tensor,
    open_mmproj,
    prefixed_weights,
    projector_type,
    with_weights,
)
from llmrun.models import gemma4_unified_media as media

MODEL_TYPE = "gemma4_unified"
# llama.cpp's projector types (tools/mtmd/clip-impl.h; gguf 0.19 names neither).
VISION_PROJECTOR, AUDIO_PROJECTOR = "gemma4uv", "gemma4ua"
# Its language model's, as a folder's config and a GGUF's (arch gemma4) say.
TEXT_MODEL_TYPES = ("gemma4_unified_text", "gemma4_text")
EXTRACTOR = "Gemma4UnifiedAudioFeatureExtractor"
GGUF_POOL = 3  # clip.cpp's pooling side where an mmproj names none, as for gemma4v
GGUF_SAMPLES = 640  # the frame clip.cpp's gemma4ua takes, whatever the file says
# A folder's image embedder keys (the Hub's, which transformers saves back; its own
# names too) -> the embedder's.
_HF_VISION = {
    "model.vision_embedder.": "",
    "model.embed_vision.embedding_projection.": "multimodal_embedder.embedding_projection.",
    "model.embed_vision.": "",
}
_AUDIO = "model.embed_audio."
# The mmproj's image tensors -> the embedder's.
_GGUF_VISION = {
    "v.patch_norm.1.weight": "patch_ln1.weight",
    "v.patch_norm.1.bias": "patch_ln1.bias",
    "v.patch_embd.weight": "patch_dense.weight",
    "v.patch_embd.bias": "patch_dense.bias",
    "v.patch_norm.2.weight": "patch_ln2.weight",
    "v.patch_norm.2.bias": "patch_ln2.bias",
    "v.patch_norm.3.weight": "pos_norm.weight",
    "v.patch_norm.3.bias": "pos_norm.bias",
    "v.position_embd.weight": "pos_embedding",
    "mm.input_projection.weight": "multimodal_embedder.embedding_projection.weight",
}
_GGUF_AUDIO = {"mm.a.input_projection.weight": "embed_audio.embedding_projection.weight"}


@dataclass
class Gemma4UnifiedVision:
    """A loaded image embedder and the image processor's token budget. Its patches are
    the embedder's (patch_size * pooling_kernel_size pixels), pooled by 1: an image cut
    into them is Gemma4UnifiedImageProcessor's merged patches (llmrun.gemma4_images
    cuts it)."""

    encoder: media.ImageEmbedder
    max_soft_tokens: int

    @property
    def patch_size(self) -> int:
        return self.encoder.args.model_patch_size

    @property
    def pool(self) -> int:
        return 1


@dataclass
class Gemma4UnifiedAudio:
    """A loaded audio embedder: a token per frame of `samples` samples."""

    encoder: media.AudioEmbedder

    @property
    def samples(self) -> int:
        return self.encoder.args.audio_embed_dim


def _config(path: Path, part: str) -> tuple[dict[str, Any], int]:
    """A Gemma 4 Unified folder's `part` config (vision_config, audio_config) and its
    language model's width."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != MODEL_TYPE or not isinstance(config.get(part), dict):
        raise UsageError(f"{path}: not a Gemma 4 Unified with a {part}")
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(text.get("hidden_size"), int):
        raise ModelFormatError(f"{path}: a Gemma 4 Unified config.json without text_config")
    return config[part], text["hidden_size"]


def folder_has_vision(path: Path) -> bool:
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_audio(path: Path) -> bool:
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def is_vision_mmproj(path: str | Path) -> bool:
    return projector_type(path) == VISION_PROJECTOR


def is_audio_mmproj(path: str | Path) -> bool:
    return whisper_audio.projector_type(path) == AUDIO_PROJECTOR


def _check_budget(tokens: int, args: media.VisionArgs, source: Path) -> None:
    """An image of `tokens` soft tokens may be that many patches wide or high: the
    position table must reach as far."""
    if tokens > args.mm_posemb_size:
        raise ModelFormatError(
            f"{source}: images of up to {tokens} tokens, but positions reach {args.mm_posemb_size}"
        )


def vision_from_hf_dir(path: Path, text_hidden: int) -> Gemma4UnifiedVision:
    """The image embedder of a Hugging Face folder (f32, on the CPU)."""
    vision, hidden = _config(path, "vision_config")
    try:
        args = media.VisionArgs.from_config(vision, hidden)
    except TypeError as e:
        raise ModelFormatError(f"{path}: vision_config: {e}") from None
    if vision.get("output_proj_dims", args.mm_embed_dim) != args.mm_embed_dim:
        raise ModelFormatError(
            f"{path}: vision_config's output_proj_dims {vision['output_proj_dims']} is not "
            f"its mm_embed_dim {args.mm_embed_dim}: the projection takes the embedder's output"
        )
    tokens = max_soft_tokens(path, args)
    _check_budget(tokens, args, path)
    weights = prefixed_weights(path, _HF_VISION)
    encoder = with_weights(media.ImageEmbedder, args, weights, path, (hidden, text_hidden))
    return Gemma4UnifiedVision(encoder, tokens)


def vision_from_mmproj(path: str | Path, text_hidden: int) -> Gemma4UnifiedVision:
    """The image embedder of llama.cpp's mmproj GGUF (projector type gemma4uv)."""
    gg, need = open_mmproj(path, VISION_PROJECTOR)
    meta = gg.metadata
    pool = meta.get(Keys.ClipVision.Projector.SCALE_FACTOR, GGUF_POOL)
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
        raise ModelFormatError(f"{gg.path}: projector scale factor {pool!r}")
    table = gg.tensors.get("v.position_embd.weight")
    if table is None or len(table.shape) != 3 or table.shape[0] != 2:
        raise ModelFormatError(f"{gg.path}: no [2, positions, width] v.position_embd.weight")
    weights = {}
    for info in gg.tensors.values():
        if info.name.startswith(("a.", "mm.a.")):
            continue
        name = _GGUF_VISION.get(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of Gemma 4 Unified's image embedder"
            )
        weights[name] = encoder_tensor(gg, info)
    projection = weights.get(_GGUF_VISION["mm.input_projection.weight"])
    if projection is None or projection.dim() != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D mm.input_projection.weight")
    args = media.VisionArgs(
        patch_size=need(Keys.ClipVision.PATCH_SIZE),
        pooling_kernel_size=pool,
        mm_embed_dim=need(Keys.ClipVision.EMBEDDING_LENGTH),
        mm_posemb_size=int(table.shape[1]),
        rms_norm_eps=float(need(Keys.ClipVision.Attention.LAYERNORM_EPS)),
        text_hidden_size=int(projection.shape[0]),
    )
    weights = _pixel_order(weights, args.model_patch_size, gg.path)
    weights["pos_embedding"] = weights["pos_embedding"].permute(1, 0, 2)
    _check_budget(DEFAULT_SOFT_TOKENS, args, gg.path)
    widths = (args.text_hidden_size, text_hidden)
    encoder = with_weights(media.ImageEmbedder, args, weights, gg.path, widths)
    return Gemma4UnifiedVision(encoder, DEFAULT_SOFT_TOKENS)


def _pixel_order(
    weights: dict[str, torch.Tensor], side: int, source: Path
) -> dict[str, torch.Tensor]:
    """The first LayerNorm and the patch projection back in HF's order (row, column,
    channel) from the converter's (channel, row, column)."""
    width = side * side * 3
    dense = weights.get("patch_dense.weight")
    if dense is None or dense.dim() != 2 or dense.shape[1] != width:
        raise ModelFormatError(f"{source}: v.patch_embd.weight does not take {width} pixels")
    # HF's index of each pixel -> its place in the converter's order
    i = torch.arange(width)
    row, column, channel = i // (side * 3), (i // 3) % side, i % 3
    place = channel * side * side + row * side + column
    out = dict(weights)
    out["patch_dense.weight"] = dense[:, place]
    for name in ("patch_ln1.weight", "patch_ln1.bias"):
        if name in out and out[name].shape == (width,):
            out[name] = out[name][place]
    return out


def audio_from_hf_dir(path: Path, text_hidden: int) -> Gemma4UnifiedAudio:
    """The audio embedder of a Hugging Face folder (f32, on the CPU)."""
    config, hidden = _config(path, "audio_config")
    width = config.get("audio_embed_dim", media.AudioArgs.audio_embed_dim)
    args = media.AudioArgs(width, float(config.get("rms_norm_eps") or 1e-6), hidden)
    _check_extractor(path, width)
    weights = prefixed_weights(path, {_AUDIO: "embed_audio."})
    encoder = with_weights(media.AudioEmbedder, args, weights, path, (hidden, text_hidden))
    return Gemma4UnifiedAudio(encoder)


def _check_extractor(path: Path, width: int) -> None:
    """The feature extractor (preprocessor_config.json, or processor_config.json's
    "feature_extractor") must frame 16 kHz audio as the embedder is wide."""
    file = path / "processor_config.json"
    values = _json(file).get("feature_extractor")
    if not isinstance(values, dict):
        file = path / "preprocessor_config.json"
        values = _json(file)
        if values.get("feature_extractor_type") != EXTRACTOR:
            return  # an image processor's, or none: the extractor's defaults
    rate = values.get("sampling_rate", 16000)
    samples = values.get("audio_samples_per_token", width)
    if rate != 16000 or samples != width:
        raise UnsupportedError(
            f"{file}: frames of {samples!r} samples at {rate!r} Hz; Gemma 4 Unified's "
            f"embedder takes {width} at 16 kHz"
        )


def _json(file: Path) -> dict[str, Any]:
    """A settings file's object; {} where there is none."""
    if not file.is_file():
        return {}
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    return values if isinstance(values, dict) else {}


def audio_from_mmproj(path: str | Path, text_hidden: int) -> Gemma4UnifiedAudio:
    """The audio embedder of llama.cpp's mmproj GGUF (audio projector type gemma4ua)."""
    gg = gguf_io.read_gguf(path)
    if not gg.metadata.get(Keys.Clip.HAS_AUDIO_ENCODER, False) or not is_audio_mmproj(gg.path):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with Gemma 4 Unified's audio")
    info = gg.tensors.get("mm.a.input_projection.weight")
    if info is None or len(info.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D mm.a.input_projection.weight")
    weight = encoder_tensor(gg, info)
    if weight.shape[1] != GGUF_SAMPLES:
        raise UnsupportedError(
            f"{gg.path}: audio frames of {weight.shape[1]} samples; llama.cpp's gemma4ua "
            f"takes {GGUF_SAMPLES}"
        )
    eps = gg.metadata.get(Keys.ClipAudio.Attention.LAYERNORM_EPS, 1e-6)
    args = media.AudioArgs(GGUF_SAMPLES, float(eps), int(weight.shape[0]))
    weights = {_GGUF_AUDIO[info.name]: weight}
    widths = (args.text_hidden_size, text_hidden)
    return Gemma4UnifiedAudio(with_weights(media.AudioEmbedder, args, weights, gg.path, widths))
