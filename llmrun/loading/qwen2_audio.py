"""Qwen2-Audio's audio encoder (Whisper's tower with its average pool, a linear projector)
from either format: its Hugging Face folder (Qwen2AudioForConditionalGeneration:
audio_tower.*, multi_modal_projector.linear.*, or transformers 5's model.-prefixed names),
or the mmproj GGUF that llama.cpp's converter writes beside the text model's GGUF (arch
qwen2; conversion/ultravox.py WhisperEncoderModel: projector type qwen2a, the projector as
mm.a.fc.*; the rest as llmrun.loading.whisper_audio reads it). Both give the encoder HF's
weights.

llama.cpp (tools/mtmd) runs every clip as whole 30-second chunks, 750 tokens each;
transformers' processor gives a clip the tokens of its own length, which llmrun follows
(llmrun.qwen2_audio_clips).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.whisper_encoder import EncoderArgs, Qwen2AudioEncoder

MODEL_TYPE = "qwen2_audio"
# Qwen2AudioConfig's audio_config defaults, for a config.json that leaves some out.
_AUDIO_DEFAULTS = {
    "d_model": 1280,
    "encoder_ffn_dim": 5120,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
}
# Checkpoint key prefixes of the audio parts (the Hub's, transformers 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
_GGUF_PROJECTOR = {"mm.a.fc": "multi_modal_projector.linear"}


@dataclass
class Qwen2Audio:
    """A loaded Qwen2-Audio audio encoder; a clip goes in as one 30-second chunk of
    log-mel features and the number of frames its audio reaches."""

    encoder: Qwen2AudioEncoder


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Qwen2-Audio with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Qwen2-Audio with its audio tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_audio(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj with Qwen2-Audio's audio encoder."""
    return whisper_audio.projector_type(path) == VisionProjectorType.QWEN2A


def from_hf_dir(path: Path, text_hidden: int) -> Qwen2Audio:
    """Qwen2-Audio's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Qwen2-Audio folder with an audio_config")
    args = encoder_args(config, path)
    return _build(args, prefixed_weights(path, _HF_PREFIXES), text_hidden, path)


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The encoder's settings from a Qwen2AudioConfig dict (of the folder `path`), with
    Qwen2AudioConfig's defaults for what it leaves out."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{path}: a Qwen2-Audio config.json without a text_config")
    # hidden_size may be left to Qwen2Config's default, as the loader's text model does.
    config = {**config, "text_config": {"hidden_size": 4096, **text}}
    return EncoderArgs.from_config(config, _AUDIO_DEFAULTS)


def from_mmproj(path: str | Path, text_hidden: int) -> Qwen2Audio:
    """The audio encoder of llama.cpp's mmproj GGUF (projector type qwen2a)."""
    gg = gguf_io.read_gguf(path)
    args = whisper_audio.mmproj_args(gg)
    weights = whisper_audio.mmproj_weights(gg, _GGUF_PROJECTOR, "Qwen2-Audio")
    return _build(args, weights, text_hidden, gg.path)


def _build(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> Qwen2Audio:
    """The encoder with `weights` (checked against its shapes), in f32."""
    widths = (args.text_hidden_size, text_hidden)
    return Qwen2Audio(with_weights(Qwen2AudioEncoder, args, weights, source, widths))
