"""Granite Speech's audio encoder (granite-speech-3.3-2b / 8b) from its Hugging Face folder
(GraniteSpeechForConditionalGeneration: the conformer as encoder.*, the Q-Former projector
as projector.*, or transformers 5's model.-prefixed names; the feature extractor's mel
settings from preprocessor_config.json), and the LoRA adapter beside them
(adapter_config.json, adapter_model.safetensors), which transformers turns on for prompts
with audio alone (GraniteSpeechForConditionalGeneration.generate).

llama.cpp's mmproj of Granite Speech (projector type granite_speech) is refused: its
converter folds the batch norms and splits to_kv, and writes the language model's GGUF
without the LoRA adapter, so llama.cpp runs the audio without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from gguf import VisionProjectorType

from llmrun import audio
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.granite_speech_clips import FeatureSettings
from llmrun.loading import lora, safetensors_io, whisper_audio
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.granite_speech_audio import EncoderArgs, GraniteSpeechEncoder

MODEL_TYPE = "granite_speech"
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


@dataclass
class GraniteSpeechAudio:
    """A loaded Granite Speech audio encoder, its feature extractor's settings, and its
    LoRA adapter (under the text model's names; None where the folder has none)."""

    encoder: GraniteSpeechEncoder
    settings: FeatureSettings
    adapter: lora.Adapter | None


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Granite Speech."""
    return config.get("model_type") == MODEL_TYPE


def folder_has_audio(path: Path) -> bool:
    return has_audio(safetensors_io.read_config(path))


def text_takes_audio(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "granite"


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF holds Granite Speech's audio encoder (which llmrun refuses)."""
    return whisper_audio.projector_type(path) == VisionProjectorType.GRANITE_SPEECH


def from_mmproj(path: str | Path, text_hidden: int) -> GraniteSpeechAudio:
    raise UnsupportedError(
        f"{path}: Granite Speech's audio encoder from an mmproj GGUF (llama.cpp runs its "
        "audio without the model's LoRA adapter); give the model's Hugging Face folder"
    )


def from_hf_dir(path: Path, text_hidden: int) -> GraniteSpeechAudio:
    """Granite Speech's audio encoder (f32, on the CPU) and LoRA adapter from its folder."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
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
    return GraniteSpeechAudio(encoder, settings, _adapter(path, config))


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
    bad = [k for k, v in values.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ModelFormatError(f"{path}: {bad[0]} is {values[bad[0]]!r}, not a positive integer")
    if not values["context_size"] <= values["max_pos_emb"]:
        raise ModelFormatError(f"{path}: context_size past max_pos_emb")
    if values["window_size"] % values["downsample_rate"]:
        raise ModelFormatError(f"{path}: window_size not a multiple of downsample_rate")
    if values["qformer_hidden_size"] % values["qformer_heads"]:
        raise ModelFormatError(f"{path}: the Q-Former's width is not whole heads")
    if values["qformer_encoder_hidden_size"] != values["hidden_dim"]:
        raise ModelFormatError(
            f"{path}: the Q-Former takes frames {values['qformer_encoder_hidden_size']} wide, "
            f"the encoder gives {values['hidden_dim']}"
        )
    eps = qformer["layer_norm_eps"]
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ModelFormatError(f"{path}: projector_config.layer_norm_eps is {eps!r}")
    return EncoderArgs(**values, qformer_layer_norm_eps=float(eps))


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
