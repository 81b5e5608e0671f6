"""Voxtral's audio encoder (Whisper's tower, Voxtral's projector) from either format: its
Hugging Face folder (VoxtralForConditionalGeneration: audio_tower.*, multi_modal_projector.*,
or transformers 5's model.-prefixed names), or the mmproj GGUF that llama.cpp's converter
writes beside the text model's GGUF (conversion/ultravox.py VoxtralWhisperEncoderModel:
projector type voxtral, stack factor 4, the projector's tensors as mm.a.mlp.*; the rest as
llmrun.loading.whisper_audio reads it). Both give the encoder HF's weights.

llama.cpp's preprocessing (tools/mtmd/mtmd-audio.cpp) differs from transformers': no
centered STFT windows and its own padding, so its chunks fall elsewhere. llmrun follows
transformers' (llmrun.audio.chunked_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.whisper_encoder import AudioEncoder, EncoderArgs

MODEL_TYPE = "voxtral"
# Checkpoint key prefixes of the audio parts (the Hub's, transformers 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# The projector's GGUF names -> Voxtral's.
_GGUF_PROJECTOR = {
    "mm.a.mlp.1": "multi_modal_projector.linear_1",
    "mm.a.mlp.2": "multi_modal_projector.linear_2",
}


@dataclass
class VoxtralAudio:
    """A loaded Voxtral audio encoder; clips go in as 30-second chunks of log-mel features."""

    encoder: AudioEncoder

    @property
    def tokens_per_chunk(self) -> int:
        return self.encoder.args.tokens_per_chunk


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a Voxtral with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Voxtral with its audio tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_audio(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj with Voxtral's audio encoder."""
    return whisper_audio.projector_type(path) == VisionProjectorType.VOXTRAL


def from_hf_dir(path: Path, text_hidden: int) -> VoxtralAudio:
    """Voxtral's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Voxtral folder with an audio_config")
    if not isinstance(config.get("text_config"), dict):
        raise ModelFormatError(f"{path}: a Voxtral config.json without a text_config")
    args = EncoderArgs.from_config(config)
    return _build(args, prefixed_weights(path, _HF_PREFIXES), text_hidden, path)


def from_mmproj(path: str | Path, text_hidden: int) -> VoxtralAudio:
    """The audio encoder of llama.cpp's mmproj GGUF (projector type voxtral)."""
    gg = gguf_io.read_gguf(path)
    args = whisper_audio.mmproj_args(gg)
    stack = gg.metadata.get(Keys.ClipAudio.Projector.STACK_FACTOR)
    if args.stack != stack:
        raise UnsupportedError(
            f"{gg.path}: stack factor {stack!r} with an FFN of {args.intermediate_size} for "
            f"width {args.hidden_size}; Voxtral's projector takes intermediate_size / width "
            "frames a row"
        )
    weights = whisper_audio.mmproj_weights(gg, _GGUF_PROJECTOR, "Voxtral")
    return _build(args, weights, text_hidden, gg.path)


def _build(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> VoxtralAudio:
    """The encoder with `weights` (checked against its shapes), in f32."""
    return VoxtralAudio(
        with_weights(AudioEncoder, args, weights, source, (args.text_hidden_size, text_hidden))
    )
