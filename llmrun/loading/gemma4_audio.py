"""Gemma 4's audio encoder (E2B, E4B) from either format: its Hugging Face folder
(Gemma4ForConditionalGeneration: model.audio_tower.*, model.embed_audio.*; the feature
extractor's settings from processor_config.json's "feature_extractor", or a
preprocessor_config.json of Gemma4AudioFeatureExtractor), or the mmproj GGUF that
llama.cpp's converter writes beside the text model's GGUF (conversion/gemma.py
Gemma4VisionAudioModel: the audio part's projector type gemma4a under clip.audio.*,
beside the image encoder's; gguf-py's a.* and mm.a.* names, softplus(per_dim_scale)
stored, the depthwise kernel as [channels, kernel], each clipped linear's bounds as
1-element tensors). Both give the encoder HF's weights; an mmproj's features take the
extractor's defaults, as llama.cpp's own do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import Keys, VisionProjectorType

from llmrun import audio
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.gemma4_audio_clips import FeatureSettings
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.vision import encoder_tensor, prefixed_weights, with_weights
from llmrun.models.gemma4_audio import AudioArgs, AudioEncoder

MODEL_TYPE = "gemma4"
EXTRACTOR = "Gemma4AudioFeatureExtractor"
_HF_PREFIXES = {"model.audio_tower.": "audio_tower.", "model.embed_audio.": "embed_audio."}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# The GGUF names of a conformer layer's modules (gguf-py's tensor_mapping, as the
# converter maps them) -> Gemma 4's.
_GGUF_LAYER = {
    "ffn_up": "feed_forward1.ffw_layer_1",
    "ffn_down": "feed_forward1.ffw_layer_2",
    "ffn_norm": "feed_forward1.pre_layer_norm",
    "ffn_post_norm": "feed_forward1.post_layer_norm",
    "ffn_up_1": "feed_forward2.ffw_layer_1",
    "ffn_down_1": "feed_forward2.ffw_layer_2",
    "ffn_norm_1": "feed_forward2.pre_layer_norm",
    "ffn_post_norm_1": "feed_forward2.post_layer_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.post",
    "attn_k_rel": "self_attn.relative_k_proj",
    "per_dim_scale": "self_attn.per_dim_scale",
    "attn_pre_norm": "norm_pre_attn",
    "attn_post_norm": "norm_post_attn",
    "ln2": "norm_out",
    # gguf-py's map crosses the two conv norms' names.
    "conv_norm": "lconv1d.pre_layer_norm",
    "norm_conv": "lconv1d.conv_norm",
    "conv_pw1": "lconv1d.linear_start",
    "conv_pw2": "lconv1d.linear_end",
    "conv_dw": "lconv1d.depthwise_conv1d",
}
_CLIPPABLE = ("ffn_up", "ffn_down", "ffn_up_1", "ffn_down_1", "attn_q", "attn_k", "attn_v",
              "attn_out", "conv_pw1", "conv_pw2")  # fmt: skip
_GGUF_NAMES = {
    "a.conv1d.0.weight": "audio_tower.subsample_conv_projection.layer0.conv.weight",
    "a.conv1d.0.norm.weight": "audio_tower.subsample_conv_projection.layer0.norm.weight",
    "a.conv1d.1.weight": "audio_tower.subsample_conv_projection.layer1.conv.weight",
    "a.conv1d.1.norm.weight": "audio_tower.subsample_conv_projection.layer1.norm.weight",
    "a.input_projection.weight": "audio_tower.subsample_conv_projection.input_proj_linear.weight",
    "a.pre_encode.out.weight": "audio_tower.output_proj.weight",
    "a.pre_encode.out.bias": "audio_tower.output_proj.bias",
    "mm.a.input_projection.weight": "embed_audio.embedding_projection.weight",
}


@dataclass
class Gemma4Audio:
    """A loaded Gemma 4 audio encoder and its feature extractor's settings."""

    encoder: AudioEncoder
    settings: FeatureSettings


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Gemma 4 with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    return has_audio(safetensors_io.read_config(path))


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF holds Gemma 4's audio encoder."""
    return whisper_audio.projector_type(path) == VisionProjectorType.GEMMA4A


def from_hf_dir(path: Path, text_hidden: int) -> Gemma4Audio:
    """Gemma 4's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Gemma 4 with an audio_config")
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(text.get("hidden_size"), int):
        raise ModelFormatError(f"{path}: a Gemma 4 config.json without text_config.hidden_size")
    settings = feature_settings(path)
    try:
        args = AudioArgs.from_config(
            config["audio_config"], text["hidden_size"], settings.feature_size
        )
    except TypeError as e:
        raise ModelFormatError(f"{path}: audio_config: {e}") from None
    return _build(args, prefixed_weights(path, _HF_PREFIXES), text_hidden, path, settings)


def feature_settings(
    path: Path,
    defaults: type = FeatureSettings,
    extractor: str = EXTRACTOR,
    family: str = "Gemma 4",
) -> Any:
    """The feature extractor's settings in a folder (processor_config.json's
    "feature_extractor", or a preprocessor_config.json of the family's `extractor`), as a
    `defaults` (a FeatureSettings); its defaults where neither is there. Random dithering
    and other rates are refused. Gemma 3n's extractor takes the same settings."""
    file = path / "processor_config.json"
    values = _json(file).get("feature_extractor") if file.is_file() else None
    if not isinstance(values, dict):
        file = path / "preprocessor_config.json"
        values = _json(file) if file.is_file() else {}
        if values.get("feature_extractor_type") != extractor:
            return defaults()  # an image processor's, or none
    if (
        values.get("dither", 0.0)
        or values.get("sampling_rate", audio.SAMPLE_RATE) != audio.SAMPLE_RATE
    ):
        raise UnsupportedError(
            f"{file}: dither {values.get('dither')!r}, sampling_rate "
            f"{values.get('sampling_rate')!r}; llmrun takes {family}'s audio at 16 kHz undithered"
        )
    known = {f.name for f in fields(defaults)}
    ms = {"frame_length": "frame_length_ms", "hop_length": "hop_length_ms"}
    chosen = {k: values[k] for k in known - set(ms) if k in values}
    try:
        for name, key in ms.items():
            if key in values:
                chosen[name] = int(round(audio.SAMPLE_RATE * float(values[key]) / 1000.0))
        for key in ("per_bin_mean", "per_bin_stddev"):
            if chosen.get(key) is not None:  # saved as [1, 1, feature_size]
                chosen[key] = tuple(np.asarray(chosen[key], dtype=np.float64).ravel().tolist())
        for key in ("min_frequency", "max_frequency", "preemphasis", "input_scale_factor",
                    "mel_floor"):  # fmt: skip
            if key in chosen:
                chosen[key] = float(chosen[key])
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{file}: feature extractor settings: {e}") from None
    settings = defaults(**chosen)
    for key in ("per_bin_mean", "per_bin_stddev"):
        value = getattr(settings, key)
        if value is not None and len(value) != settings.feature_size:
            raise ModelFormatError(f"{file}: {key} has {len(value)} values, not feature_size")
    if settings.frame_length < 2 or settings.hop_length < 1 or settings.feature_size < 1:
        raise ModelFormatError(f"{file}: frames of {settings.frame_length} samples every "
                               f"{settings.hop_length}, {settings.feature_size} mel bins")  # fmt: skip
    return settings


def _json(file: Path) -> dict[str, Any]:
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    return values if isinstance(values, dict) else {}


def from_mmproj(path: str | Path, text_hidden: int) -> Gemma4Audio:
    """The audio encoder of llama.cpp's mmproj GGUF (audio projector type gemma4a)."""
    gg = gguf_io.read_gguf(path)
    meta = gg.metadata
    if not meta.get(Keys.Clip.HAS_AUDIO_ENCODER, False) or not is_mmproj(gg.path):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with Gemma 4's audio encoder")

    def need(key: str) -> int:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    def shape(name: str, dims: int) -> list[int]:
        info = gg.tensors.get(name)
        if info is None or len(info.shape) != dims:
            raise ModelFormatError(f"{gg.path}: no {dims}-D {name}")
        return list(info.shape)

    key = Keys.ClipAudio
    weights = {}
    for info in gg.tensors.values():
        if not info.name.startswith(("a.", "mm.a.")):
            continue  # the image encoder's
        name = _gguf_name(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of Gemma 4's audio encoder"
            )
        tensor = encoder_tensor(gg, info).float()
        if name.endswith(_BOUNDS):
            if tensor.numel() != 1:
                raise ModelFormatError(f"{gg.path}: {info.name} is not one number")
            tensor = tensor.reshape(())
        elif name.endswith("per_dim_scale"):
            # The file holds softplus(p): p = y + log(1 - exp(-y)).
            wide = tensor.double()
            tensor = (wide + torch.log(-torch.expm1(-wide))).float()
        elif name.endswith("depthwise_conv1d.weight"):
            tensor = tensor[:, None, :]  # [channels, kernel] -> Conv1d's [channels, 1, kernel]
        weights[name] = tensor
    first = shape("a.conv1d.0.weight", 4)
    second = shape("a.conv1d.1.weight", 4)
    output = shape("a.pre_encode.out.weight", 2)
    kernel = shape("a.blk.0.conv_dw.weight", 2)
    args = AudioArgs(
        hidden_size=need(key.EMBEDDING_LENGTH),
        num_hidden_layers=need(key.BLOCK_COUNT),
        num_attention_heads=need(key.Attention.HEAD_COUNT),
        subsampling_conv_channels=(first[0], second[0]),  # [out, in, 3, 3]
        conv_kernel_size=kernel[1],  # [channels, kernel]
        use_clipped_linears=any(
            n.startswith("a.") and n.endswith(".input_max") for n in gg.tensors
        ),
        output_proj_dims=output[0],
        num_mel_bins=need(key.NUM_MEL_BINS),
        text_hidden_size=need(key.PROJECTION_DIM),
    )
    return _build(args, weights, text_hidden, gg.path, FeatureSettings(args.num_mel_bins))


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["a", "blk"] or not parts[2].isdigit():
        return None
    module, suffix = _GGUF_LAYER.get(parts[3]), parts[4]
    if module is None:
        return None
    prefix = f"audio_tower.layers.{parts[2]}.{module}"
    if parts[3] in _CLIPPABLE:
        if suffix in _BOUNDS:
            return f"{prefix}.{suffix}"
        return f"{prefix}.linear.weight" if suffix == "weight" else None
    if parts[3] == "per_dim_scale":
        return prefix if suffix == "weight" else None
    return f"{prefix}.weight" if suffix == "weight" else None


def _build(
    args: AudioArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    settings: FeatureSettings,
) -> Gemma4Audio:
    """The encoder with `weights` (checked against its shapes), in f32, once its settings
    are ones llmrun runs as transformers does."""
    sizes = (args.hidden_size, args.num_hidden_layers, args.num_attention_heads,
             args.conv_kernel_size, args.output_proj_dims, *args.subsampling_conv_channels,
             args.attention_chunk_size, args.attention_context_left)  # fmt: skip
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        raise ModelFormatError(f"{source}: audio sizes {sizes} are not all positive integers")
    if args.hidden_size % args.num_attention_heads or args.hidden_size % 2:
        raise ModelFormatError(
            f"{source}: an audio width of {args.hidden_size} in "
            f"{args.num_attention_heads} heads (an even width, whole heads)"
        )
    if args.hidden_act not in ("silu", "swish"):
        raise UnsupportedError(f"{source}: audio hidden_act {args.hidden_act!r}; Gemma 4's is silu")
    if args.attention_context_right != 0 or args.attention_chunk_size != args.past_frames:
        raise UnsupportedError(
            f"{source}: audio attention of chunks of {args.attention_chunk_size}, context "
            f"{args.attention_context_left} left and {args.attention_context_right} right; "
            "llmrun runs Gemma 4's (chunks of context left - 1, none right)"
        )
    first, _ = args.subsampling_conv_channels
    if (args.num_mel_bins + 3) // 4 != first // 4:  # the convolutions' bins, rounded up
        raise ModelFormatError(
            f"{source}: {args.num_mel_bins} mel bins, but the audio tower's projection "
            f"takes {first // 4} bins a channel after its convolutions"
        )
    encoder = with_weights(
        AudioEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Gemma4Audio(encoder, settings)
