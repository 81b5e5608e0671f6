"""VibeVoice-ASR's audio encoder from its Hugging Face folder, as transformers saves
VibeVoiceAsrForConditionalGeneration (microsoft/VibeVoice-ASR-HF: acoustic and semantic
tokenizer encoder configs, acoustic_tokenizer_encoder.*, semantic_tokenizer_encoder.*,
multi_modal_projector.*, or the same under model.), with its feature extractor's
settings (processor_config.json's "feature_extractor" or preprocessor_config.json,
VibeVoiceAcousticTokenizerFeatureExtractor's defaults where they leave them out). llama.cpp writes no mmproj for it: folders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import feature_extractor, prefixed_weights, with_weights
from llmrun.models.vibevoice_asr_audio import EncoderArgs, TokenizerArgs, VibeVoiceAsrEncoder

MODEL_TYPE = "vibevoice_asr"
SAMPLE_RATE = 24000
_PREFIXES = {
    f"{model}{part}.": f"{part}."
    for model in ("model.", "")
    for part in (
        "acoustic_tokenizer_encoder",
        "semantic_tokenizer_encoder",
        "multi_modal_projector",
    )
}


@dataclass
class VibeVoiceAsrAudio:
    """A loaded VibeVoice-ASR audio encoder, and how its feature extractor scales a clip:
    to `target_db` dB FS (as a level of its root mean square), then down where a sample
    passes 1, where `normalize`."""

    encoder: VibeVoiceAsrEncoder
    normalize: bool = True
    target_db: float = -25.0
    eps: float = 1e-6


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a config.json dict is a VibeVoice-ASR's with its tokenizer encoders."""
    return config.get("model_type") == MODEL_TYPE and all(
        isinstance(config.get(f"{part}_tokenizer_encoder_config"), dict)
        for part in ("acoustic", "semantic")
    )


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a VibeVoice-ASR folder with its tokenizer encoders' configs."""
    return has_audio(safetensors_io.read_json(path / "config.json"))


def from_hf_dir(path: Path, text_hidden: int) -> VibeVoiceAsrAudio:
    """VibeVoice-ASR's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a VibeVoice-ASR folder with its tokenizer encoders")
    text = config.get("text_config") or {}
    args = EncoderArgs(
        acoustic=TokenizerArgs.from_config(config["acoustic_tokenizer_encoder_config"]),
        semantic=TokenizerArgs.from_config(config["semantic_tokenizer_encoder_config"]),
        text_hidden_size=text.get("hidden_size", 4096),  # Qwen2Config's default
        chunk_samples=config.get("acoustic_tokenizer_chunk_size", 1440000),
    )
    file, values = feature_extractor(path)
    rate, multiple = (
        values.get("sampling_rate", SAMPLE_RATE),
        values.get("pad_to_multiple_of", 3200),
    )
    if rate != SAMPLE_RATE:
        raise UnsupportedError(
            f"{file}: sampling_rate {rate!r}; VibeVoice-ASR takes {SAMPLE_RATE} Hz"
        )
    if multiple != args.acoustic.hop_length:
        raise ModelFormatError(
            f"{file}: pad_to_multiple_of {multiple!r}, but the encoder's hop is "
            f"{args.acoustic.hop_length} samples"
        )
    for key in ("target_dB_FS", "eps"):
        value = values.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelFormatError(f"{file}: {key} is {value!r}, not a number")
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(
        VibeVoiceAsrEncoder, args, weights, path, (args.text_hidden_size, text_hidden)
    )
    return VibeVoiceAsrAudio(
        encoder,
        normalize=bool(values.get("normalize_audio", True)),
        target_db=float(values.get("target_dB_FS", -25.0)),
        eps=float(values.get("eps", 1e-6)),
    )


def from_mmproj(path: str | Path, text_hidden: int) -> VibeVoiceAsrAudio:
    raise UnsupportedError(f"{path}: llama.cpp writes no mmproj for VibeVoice-ASR's audio encoders")


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen2's (a VibeVoice-ASR folder's text_config)."""
    return config.get("model_type") == "qwen2"
