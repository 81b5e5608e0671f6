"""Muse Spark's audio encoder (llmrun.models.muse_spark_audio) from its Hugging Face folder
(MuseSparkForConditionalGeneration's model.audio_tower.*). llama.cpp has no converter for
Muse Spark, so no mmproj holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.muse_spark_audio import AudioEncoder, EncoderArgs

MODEL_TYPE, TEXT_MODEL_TYPE = "muse_spark", "muse_spark_text"
SAMPLE_RATE = 24000  # MuseSparkFeatureExtractor's: the encoder takes 24 kHz waveforms
_HF_PREFIXES = {"model.audio_tower.": ""}


@dataclass
class MuseSparkAudio:
    """A loaded Muse Spark audio encoder."""

    encoder: AudioEncoder


def has_audio(config: dict[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Muse Spark with its audio tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_audio(safetensors_io.read_json(config))


def text_takes_audio(config: dict[str, Any]) -> bool:
    return config.get("model_type") == TEXT_MODEL_TYPE


def from_hf_dir(path: Path, text_hidden: int) -> MuseSparkAudio:
    """Muse Spark's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Muse Spark folder with an audio_config")
    try:
        args = EncoderArgs.from_config(config)
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None
    weights = prefixed_weights(path, _HF_PREFIXES)
    widths = (args.out_hidden_size, text_hidden)
    return MuseSparkAudio(with_weights(AudioEncoder, args, weights, path, widths))


def from_mmproj(path: str | Path, text_hidden: int) -> MuseSparkAudio:
    raise UnsupportedError(f"{path}: llama.cpp writes no mmproj for Muse Spark's audio tower")
