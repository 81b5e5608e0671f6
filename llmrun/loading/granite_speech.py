"""Granite Speech's audio encoder (granite-speech-3.3-2b / 8b) from its Hugging Face folder
(GraniteSpeechForConditionalGeneration: the conformer as encoder.*, the Q-Former projector
as projector.*, or transformers 5's model.-prefixed names; the feature extractor's mel
settings from preprocessor_config.json), and the LoRA adapter beside them
(adapter_config.json, adapter_model.safetensors), which transformers turns on for prompts
with audio alone (GraniteSpeechForConditionalGeneration.generate).

Granite Speech Plus (granite-speech-4.1-2b-plus, GraniteSpeechPlusForConditionalGeneration)
is the same with encoder_config.cat_hidden_layers, whose layers' outputs its projector reads
beside the last one's; its folder has no LoRA adapter (has_lora_adapter false). It also
loads from the mmproj GGUF that llama.cpp's converter writes of it (projector type
granite_speech with clip.audio.feature_layer), beside the text GGUF: the converter splits
to_kv into to_k and to_v, drops the convolutions' unit dimensions and folds each batch
norm's running statistics into its weight and bias (eps 1e-5), which llmrun takes as a batch
norm of mean 0, variance 1 and eps 0.

llama.cpp's mmproj of Granite Speech without feature layers is refused: the converter
writes the language model's GGUF without the LoRA adapter that granite-speech-3.3 has, so
llama.cpp runs the audio without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun import audio
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.granite_speech_clips import FeatureSettings
from llmrun.loading import gguf_io, lora, safetensors_io, whisper_audio
from llmrun.loading.vision import mmproj_tensors, prefixed_weights, with_weights
from llmrun.models.granite_speech_audio import EncoderArgs, GraniteSpeechEncoder

MODEL_TYPE = "granite_speech"
PLUS_MODEL_TYPE = "granite_speech_plus"
# gguf-py's Keys.ClipAudio.FEATURE_LAYERS, newer than the installed gguf.
FEATURE_LAYERS = "clip.audio.feature_layer"
EXTRACTOR = "GraniteSpeechFeatureExtractor"
_HF_PREFIXES = {
    "model.encoder.": "encoder.",
    "model.projector.": "projector.",
    "encoder.": "encoder.",
    "projector.": "projector.",
}
# The adapter's module names (transformers 5's, and the Hub's older layout) -> the text model's.
_ADAPTER_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model."}
# GraniteSpeechEncoderConfig's and Blip2QFormerConfig's defaults.
_ENCODER_DEFAULTS = {
    "input_dim": 160,
    "num_layers": 10,
    "hidden_dim": 1024,
    "feedforward_mult": 4,
    "num_heads": 8,
    "output_dim": 42,
    "context_size": 200,
    "max_pos_emb": 512,
    "conv_kernel_size": 15,
    "conv_expansion_factor": 2,
}
_QFORMER_DEFAULTS = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "encoder_hidden_size": 1408,
    "cross_attention_frequency": 2,
    "layer_norm_eps": 1e-12,
}
# The mmproj's tensors (gguf-py's names) -> the encoder's: whole ones, a conformer layer's
# (a.blk.N.<part>) and a Q-Former layer's (a.proj_blk.N.<part>).
_GGUF_MODULES = {
    "a.input_projection": "encoder.input_linear",
    "a.enc_ctc_out": "encoder.out",
    "a.enc_ctc_out_mid": "encoder.out_mid",
    "a.proj_norm": "projector.qformer.layernorm",
    "a.proj_linear": "projector.linear",
}
_GGUF_LAYER = {
    "ffn_norm": "ff1.pre_norm",
    "ffn_up": "ff1.up_proj",
    "ffn_down": "ff1.down_proj",
    "ln1": "attn.pre_norm",
    "attn_q": "attn.to_q",
    "attn_k": "attn.to_k",
    "attn_v": "attn.to_v",
    "attn_out": "attn.to_out",
    "norm_conv": "conv.norm",
    "conv_pw1": "conv.up_conv",
    "conv_dw": "conv.depth_conv.conv",
    # The folded batch norm: conv_norm_var as the converter names it, conv_norm as
    # llama.cpp's clip loader reads it (TN_CONV_NORM).
    "conv_norm_var": "conv.batch_norm",
    "conv_norm": "conv.batch_norm",
    "conv_pw2": "conv.down_conv",
    "ffn_norm_1": "ff2.pre_norm",
    "ffn_up_1": "ff2.up_proj",
    "ffn_down_1": "ff2.down_proj",
    "ln2": "post_norm",
}
_GGUF_QFORMER_LAYER = {
    f"{kind}_{part}": f"{module}.{name}"
    for kind, module in (("self_attn", "attention"), ("cross_attn", "crossattention"))
    for part, name in (
        ("q", "attention.query"),
        ("k", "attention.key"),
        ("v", "attention.value"),
        ("out", "output.dense"),
        ("norm", "output.LayerNorm"),
    )
} | {
    "ffn_up": "intermediate_query.dense",
    "ffn_down": "output_query.dense",
    "ffn_norm": "output_query.LayerNorm",
}


@dataclass
class GraniteSpeechAudio:
    """A loaded Granite Speech audio encoder, its feature extractor's settings, and its
    LoRA adapter (under the text model's names; None where the folder has none)."""

    encoder: GraniteSpeechEncoder
    settings: FeatureSettings
    adapter: lora.Adapter | None


@dataclass
class GraniteSpeechPlusAudio(GraniteSpeechAudio):
    """A loaded Granite Speech Plus audio encoder (its projector reads cat_hidden_layers)."""


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Granite Speech."""
    return config.get("model_type") == MODEL_TYPE


def folder_has_audio(path: Path) -> bool:
    return has_audio(safetensors_io.read_config(path))


def plus_folder_has_audio(path: Path) -> bool:
    """Whether a Hugging Face folder is that of a Granite Speech Plus."""
    return safetensors_io.read_config(path).get("model_type") == PLUS_MODEL_TYPE


def text_takes_audio(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "granite"


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF holds Granite Speech's audio encoder (which llmrun refuses)."""
    return whisper_audio.projector_type(path) == VisionProjectorType.GRANITE_SPEECH


def plus_is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF holds Granite Speech Plus's audio encoder (Granite Speech's
    with feature layers)."""
    return is_mmproj(path) and FEATURE_LAYERS in gguf_io.read_gguf(path).metadata


def from_mmproj(path: str | Path, text_hidden: int) -> GraniteSpeechAudio:
    raise UnsupportedError(
        f"{path}: Granite Speech's audio encoder from an mmproj GGUF (llama.cpp runs its "
        "audio without the model's LoRA adapter); give the model's Hugging Face folder"
    )


def from_hf_dir(path: Path, text_hidden: int) -> GraniteSpeechAudio:
    """Granite Speech's or Granite Speech Plus's audio encoder (f32, on the CPU) and LoRA
    adapter from its folder."""
    config = safetensors_io.read_config(path)
    plus = config.get("model_type") == PLUS_MODEL_TYPE
    if not (plus or has_audio(config)):
        raise UsageError(f"{path}: not a Granite Speech folder")
    args = encoder_args(config, text_hidden, path)
    settings = feature_settings(path, config)
    if 2 * settings.n_mels != args.input_dim:
        raise ModelFormatError(
            f"{path}: the feature extractor gives 2 x {settings.n_mels} features a frame, "
            f"the encoder takes {args.input_dim}"
        )
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _HF_PREFIXES).items()
        if not name.endswith("num_batches_tracked")
    }
    widths = (args.text_hidden_size, text_hidden)
    encoder = with_weights(GraniteSpeechEncoder, args, weights, path, widths)
    loaded = GraniteSpeechPlusAudio if plus else GraniteSpeechAudio
    return loaded(encoder, settings, _adapter(path, config))


def plus_from_mmproj(path: str | Path, text_hidden: int) -> GraniteSpeechPlusAudio:
    """Granite Speech Plus's audio encoder from llama.cpp's mmproj GGUF (f32, on the CPU),
    with the feature extractor's default settings (those llama.cpp's preprocessor uses)."""
    gg = gguf_io.read_gguf(path)
    meta, audio_keys = gg.metadata, Keys.ClipAudio
    if not meta.get(Keys.Clip.HAS_AUDIO_ENCODER, False) or not plus_is_mmproj(path):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF of Granite Speech Plus")

    def need(key: str) -> Any:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    weights = mmproj_tensors(gg, _gguf_name, "Granite Speech Plus's audio encoder")
    hidden, layers = need(audio_keys.EMBEDDING_LENGTH), need(audio_keys.BLOCK_COUNT)
    for i in range(layers):
        attn, conv = f"encoder.layers.{i}.attn.", f"encoder.layers.{i}.conv."
        k, v = weights.pop(attn + "to_k.weight", None), weights.pop(attn + "to_v.weight", None)
        if k is None or v is None:
            raise ModelFormatError(f"{gg.path}: a.blk.{i} lacks attn_k or attn_v")
        weights[attn + "to_kv.weight"] = torch.cat([k, v])
        # The convolutions' unit dimensions back: [out, in] -> [out, in, 1] pointwise,
        # [channels, kernel] -> [channels, 1, kernel] depthwise.
        for name, unit in (("up_conv", -1), ("down_conv", -1), ("depth_conv.conv", 1)):
            if f"{conv}{name}.weight" in weights:
                weights[f"{conv}{name}.weight"] = weights[f"{conv}{name}.weight"].unsqueeze(unit)
        if conv + "batch_norm.weight" in weights:
            channels = len(weights[conv + "batch_norm.weight"])
            weights[conv + "batch_norm.running_mean"] = torch.zeros(channels)
            weights[conv + "batch_norm.running_var"] = torch.ones(channels)

    def shape(name: str, dim: int) -> int:
        tensor = weights.get(name)
        if tensor is None or tensor.dim() <= dim:
            raise ModelFormatError(f"{gg.path}: no tensor for {name} with {dim + 1} dimensions")
        return tensor.shape[dim]

    qformer_layers = {
        int(n.split(".")[4]) for n in weights if n.startswith("projector.qformer.encoder.layer.")
    }
    feature_layers = meta.get(FEATURE_LAYERS)
    ffn = need(audio_keys.FEED_FORWARD_LENGTH)
    if ffn % hidden:
        raise ModelFormatError(f"{gg.path}: feed-forward width {ffn} not a multiple of {hidden}")
    values = {
        "input_dim": need(audio_keys.NUM_MEL_BINS),
        "num_layers": layers,
        "hidden_dim": hidden,
        "feedforward_mult": ffn // hidden,
        "num_heads": need(audio_keys.Attention.HEAD_COUNT),
        "dim_head": shape("encoder.layers.0.attn.rel_pos_emb.weight", 1),
        "output_dim": shape("encoder.out.weight", 0),
        "context_size": need(audio_keys.CHUNK_SIZE),
        "max_pos_emb": need(audio_keys.MAX_POS_EMB),
        "conv_kernel_size": need(audio_keys.CONV_KERNEL_SIZE),
        "conv_expansion_factor": shape("encoder.layers.0.conv.up_conv.weight", 0) // (2 * hidden),
        "qformer_hidden_size": shape("projector.qformer.layernorm.weight", 0),
        "qformer_layers": len(qformer_layers),
        "qformer_heads": need(audio_keys.Projector.HEAD_COUNT),
        "qformer_intermediate_size": shape(
            "projector.qformer.encoder.layer.0.intermediate_query.dense.weight", 0
        ),
        # llama.cpp's graph gives every Q-Former layer cross-attention.
        "qformer_encoder_hidden_size": shape(
            "projector.qformer.encoder.layer.0.crossattention.attention.key.weight", 1
        ),
        "qformer_cross_attention_frequency": 1,
        "window_size": need(audio_keys.Projector.WINDOW_SIZE),
        "downsample_rate": need(audio_keys.Projector.DOWNSAMPLE_RATE),
        "text_hidden_size": need(audio_keys.PROJECTION_DIM),
    }
    settings = FeatureSettings()
    if 2 * settings.n_mels != values["input_dim"]:
        raise ModelFormatError(
            f"{gg.path}: the encoder takes {values['input_dim']} features a frame, the feature "
            f"extractor gives 2 x {settings.n_mels}"
        )
    # llama.cpp's Q-Former layer norms' eps (clip-graph's proj_eps), the batch norms folded.
    args = _checked(values, feature_layers, 1e-12, gg.path, batch_norm_eps=0.0)
    encoder = with_weights(
        GraniteSpeechEncoder, args, weights, gg.path, (args.text_hidden_size, text_hidden)
    )
    return GraniteSpeechPlusAudio(encoder, settings, None)


def _gguf_name(name: str) -> str | None:
    """An mmproj tensor's name in the encoder; None for one it does not have."""
    if name == "a.proj_query":
        return "projector.query"
    module, _, suffix = name.rpartition(".")
    if module in _GGUF_MODULES and suffix in ("weight", "bias"):
        return f"{_GGUF_MODULES[module]}.{suffix}"
    parts = name.split(".")
    if len(parts) == 4 and parts[:2] == ["a", "blk"] and parts[3] == "attn_rel_pos_emb":
        return f"encoder.layers.{parts[2]}.attn.rel_pos_emb.weight" if parts[2].isdigit() else None
    if len(parts) != 5 or not parts[2].isdigit() or parts[4] not in ("weight", "bias"):
        return None
    if parts[:2] == ["a", "blk"] and parts[3] in _GGUF_LAYER:
        return f"encoder.layers.{parts[2]}.{_GGUF_LAYER[parts[3]]}.{parts[4]}"
    if parts[:2] == ["a", "proj_blk"] and parts[3] in _GGUF_QFORMER_LAYER:
        layer = f"projector.qformer.encoder.layer.{parts[2]}"
        return f"{layer}.{_GGUF_QFORMER_LAYER[parts[3]]}.{parts[4]}"
    return None


def encoder_args(config: dict[str, Any], text_hidden: int, path: Path) -> EncoderArgs:
    """The encoder's and projector's settings, with their config classes' defaults."""
    encoder = {**_ENCODER_DEFAULTS, **_section(config, "encoder_config", path)}
    qformer = {**_QFORMER_DEFAULTS, **_section(config, "projector_config", path)}
    if qformer.get("hidden_act", "gelu") != "gelu" or qformer.get("use_qformer_text_input"):
        raise UnsupportedError(
            f"{path}: a Q-Former with hidden_act {qformer.get('hidden_act')!r} or text input; "
            "llmrun runs Granite Speech's (gelu, queries alone)"
        )
    heads = encoder["num_heads"]
    values = {
        **{k: encoder[k] for k in _ENCODER_DEFAULTS},
        "dim_head": encoder.get("dim_head") or encoder["hidden_dim"] // max(heads, 1),
        "qformer_hidden_size": qformer["hidden_size"],
        "qformer_layers": qformer["num_hidden_layers"],
        "qformer_heads": qformer["num_attention_heads"],
        "qformer_intermediate_size": qformer["intermediate_size"],
        "qformer_encoder_hidden_size": qformer["encoder_hidden_size"],
        "qformer_cross_attention_frequency": qformer["cross_attention_frequency"],
        "window_size": config.get("window_size", 15),
        "downsample_rate": config.get("downsample_rate", 5),
        "text_hidden_size": _section(config, "text_config", path).get("hidden_size", text_hidden),
    }
    # GraniteSpeechEncoderConfig has no cat_hidden_layers: Granite Speech Plus's alone.
    cat = encoder.get("cat_hidden_layers") if config.get("model_type") == PLUS_MODEL_TYPE else None
    eps = qformer["layer_norm_eps"]
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ModelFormatError(f"{path}: projector_config.layer_norm_eps is {eps!r}")
    return _checked(values, cat, float(eps), path)


def _checked(
    values: dict[str, Any],
    cat_hidden_layers: Any,
    qformer_eps: float,
    path: Path,
    batch_norm_eps: float = 1e-5,
) -> EncoderArgs:
    """EncoderArgs of `values` once they and cat_hidden_layers (None, or distinct layers
    from 0 to num_layers - 1, as GraniteSpeechPlusConfig checks) agree."""
    bad = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ModelFormatError(f"{path}: {bad[0]} is {values[bad[0]]!r}, not a positive integer")
    if not values["context_size"] <= values["max_pos_emb"]:
        raise ModelFormatError(f"{path}: context_size past max_pos_emb")
    if values["window_size"] % values["downsample_rate"]:
        raise ModelFormatError(f"{path}: window_size not a multiple of downsample_rate")
    if values["qformer_hidden_size"] % values["qformer_heads"]:
        raise ModelFormatError(f"{path}: the Q-Former's width is not whole heads")
    cat = [] if cat_hidden_layers is None else cat_hidden_layers
    if (
        not isinstance(cat, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in cat)
        or len(set(cat)) != len(cat)
        or not all(0 <= i < values["num_layers"] for i in cat)
    ):
        raise ModelFormatError(
            f"{path}: cat_hidden_layers {cat_hidden_layers!r}: distinct layers from 0 to "
            f"{values['num_layers'] - 1}"
        )
    width = values["hidden_dim"] * (len(cat) + 1)
    if values["qformer_encoder_hidden_size"] != width:
        raise ModelFormatError(
            f"{path}: the Q-Former takes frames {values['qformer_encoder_hidden_size']} wide, "
            f"the encoder gives {width}"
        )
    return EncoderArgs(
        **values,
        cat_hidden_layers=tuple(sorted(cat)),
        batch_norm_eps=batch_norm_eps,
        qformer_layer_norm_eps=qformer_eps,
    )


def _section(config: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    """A sub-config of config.json ({} where absent)."""
    section = config.get(key) or {}
    if not isinstance(section, dict):
        raise ModelFormatError(f"{path}: config.json's {key} is not an object")
    return section


def feature_settings(path: Path, config: dict[str, Any]) -> FeatureSettings:
    """The mel settings of the folder's preprocessor_config.json (the top-level n_fft,
    win_length, hop_length, n_mels that GraniteSpeechFeatureExtractor's __init__ reads),
    its defaults where absent. Its projector window must be the model's."""
    file = path / "preprocessor_config.json"
    try:
        values = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(values, dict) or values.get("feature_extractor_type") != EXTRACTOR:
        return FeatureSettings()
    if values.get("sampling_rate", audio.SAMPLE_RATE) != audio.SAMPLE_RATE:
        raise UnsupportedError(f"{file}: sampling_rate {values['sampling_rate']!r}, not 16 kHz")
    for key, own, default in (
        ("projector_window_size", "window_size", 15),
        ("projector_downsample_rate", "downsample_rate", 5),
    ):
        if values.get(key, default) != config.get(own, default):
            raise ModelFormatError(
                f"{file}: {key} {values.get(key, default)!r} is not the model's {own}"
            )
    chosen = {f.name: values[f.name] for f in fields(FeatureSettings) if f.name in values}
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in chosen.values())
    settings = FeatureSettings(**chosen)
    if not valid or settings.win_length > settings.n_fft:
        raise ModelFormatError(f"{file}: mel settings {chosen} (positive, a window within the FFT)")
    return settings


def _adapter(path: Path, config: dict[str, Any]) -> lora.Adapter | None:
    """The folder's LoRA adapter under the text model's module names; None without one."""
    if not (path / lora.PEFT_CONFIG).is_file():
        if config.get("has_lora_adapter", True):
            raise ModelFormatError(
                f"{path}: the config says the model has a LoRA adapter, and the folder has no "
                f"{lora.PEFT_CONFIG}"
            )
        return None
    adapter = lora.read_adapter(path, 1.0, config, None, torch.float32, torch.device("cpu"))
    renamed = {}
    for name, weight in adapter.weights.items():
        old = next((p for p in _ADAPTER_PREFIXES if name.startswith(p)), None)
        if old is None:
            raise UnsupportedError(
                f"{path / lora.PEFT_WEIGHTS}: {name} is not in the language model; llmrun "
                "takes Granite Speech's adapter on its language model alone"
            )
        renamed[_ADAPTER_PREFIXES[old] + name[len(old) :]] = weight
    adapter.weights = renamed
    return adapter
