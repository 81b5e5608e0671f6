"""Audio Flamingo 3's audio encoder (Whisper's tower with Qwen2-Audio's pool, a two-layer
projector) from either format: its Hugging Face folder (AudioFlamingo3ForConditionalGeneration:
audio_tower.*, multi_modal_projector.linear_1/2.*, or transformers 5's model.-prefixed
names), or the mmproj GGUF that llama.cpp's converter writes beside the text model's GGUF
(arch qwen2; conversion/ultravox.py AudioFlamingo3WhisperEncoderModel: projector type
musicflamingo, the projector as mm.a.mlp.1/2; the rest as llmrun.loading.whisper_audio
reads it). Both give the encoder HF's weights.

Music Flamingo's (MusicFlamingoForConditionalGeneration: the same weights, rotary time
embeddings from its config's rope_parameters and audio_frame_step) from its folder only:
llama.cpp's converter takes no Music Flamingo, and its musicflamingo graph runs no rotary
time embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.audioflamingo3_audio import (
    AudioFlamingo3Encoder,
    MusicFlamingoEncoder,
    TimeRope,
)
from llmrun.models.whisper_encoder import EncoderArgs

MODEL_TYPE = "audioflamingo3"
MUSIC_MODEL_TYPE = "musicflamingo"
# MusicFlamingoConfig's defaults for its rotary time embeddings.
_ROPE_THETA, _ROTARY_FACTOR, _FRAME_STEP = 1200.0, 0.2, 0.01
# AudioFlamingo3EncoderConfig's defaults, for a config.json that leaves some out.
_AUDIO_DEFAULTS = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
}
_TEXT_HIDDEN = 4096  # Qwen2Config's default width
# Checkpoint key prefixes of the audio parts (the Hub's, transformers 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
_GGUF_PROJECTOR = {
    "mm.a.mlp.1": "multi_modal_projector.linear_1",
    "mm.a.mlp.2": "multi_modal_projector.linear_2",
}


@dataclass
class AudioFlamingo3Audio:
    """A loaded Audio Flamingo 3 audio encoder; a clip goes in as 30-second windows of
    log-mel features, each with the number of frames its audio reaches."""

    encoder: AudioFlamingo3Encoder


@dataclass
class MusicFlamingoAudio(AudioFlamingo3Audio):
    """A loaded Music Flamingo audio encoder; a clip's windows go in with their index."""

    encoder: MusicFlamingoEncoder


def has_audio(config: dict[str, Any], model_type: str = MODEL_TYPE) -> bool:
    """Whether a Hugging Face config.json is that of an Audio Flamingo 3 (or of
    `model_type`) with its tower."""
    return config.get("model_type") == model_type and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of an Audio Flamingo 3 with its tower."""
    return has_audio(safetensors_io.read_json(path / "config.json"))


def music_folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Music Flamingo with its tower."""
    return has_audio(safetensors_io.read_json(path / "config.json"), MUSIC_MODEL_TYPE)


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj with Audio Flamingo 3's audio encoder."""
    return whisper_audio.projector_type(path) == VisionProjectorType.MUSIC_FLAMINGO


def from_hf_dir(path: Path, text_hidden: int) -> AudioFlamingo3Audio:
    """Audio Flamingo 3's or Music Flamingo's audio encoder from its Hugging Face folder
    (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not (has_audio(config) or has_audio(config, MUSIC_MODEL_TYPE)):
        raise UsageError(f"{path}: not an Audio Flamingo 3 folder with an audio_config")
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = {}
    # Each left out takes its config class's default, as the loader's text model does.
    config = {**config, "text_config": {"hidden_size": _TEXT_HIDDEN, **text}}
    args = EncoderArgs.from_config(config, _AUDIO_DEFAULTS)
    weights = prefixed_weights(path, _HF_PREFIXES)
    if not has_audio(config, MUSIC_MODEL_TYPE):
        return _build(args, weights, text_hidden, path)
    rope = _time_rope(config, args, path)
    widths = (args.text_hidden_size, text_hidden)
    encoder = with_weights(lambda a: MusicFlamingoEncoder(a, rope), args, weights, path, widths)
    return MusicFlamingoAudio(encoder)


def _time_rope(config: dict[str, Any], args: EncoderArgs, path: Path) -> TimeRope:
    """A MusicFlamingoConfig's rotary time settings, its defaults where it gives none."""
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelFormatError(f"{path}: rope_parameters is {rope!r}")
    theta = rope.get("rope_theta", _ROPE_THETA)
    factor = rope.get("partial_rotary_factor", _ROTARY_FACTOR)
    step = config.get("audio_frame_step", _FRAME_STEP)
    if rope.get("rope_type", "default") != "default":
        raise ModelFormatError(
            f"{path}: rope_type {rope['rope_type']!r}: Music Flamingo's is default"
        )
    for name, value in (
        ("rope_theta", theta),
        ("partial_rotary_factor", factor),
        ("audio_frame_step", step),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelFormatError(f"{path}: {name} is {value!r}")
    dim = int(args.hidden_size * factor)
    if dim % 2 or 2 * dim > args.hidden_size or int(theta) < args.max_source_positions // 2:
        raise ModelFormatError(
            f"{path}: rotary time embeddings of {dim} features an axis (rope_theta {theta}) "
            f"do not fit audio features of {args.hidden_size} ({args.max_source_positions // 2} "
            "a window)"
        )
    return TimeRope(theta=float(theta), dim=dim, frame_step=float(step))


def from_mmproj(path: str | Path, text_hidden: int) -> AudioFlamingo3Audio:
    """The audio encoder of llama.cpp's mmproj GGUF (projector type musicflamingo)."""
    gg = gguf_io.read_gguf(path)
    args = whisper_audio.mmproj_args(gg)
    weights = whisper_audio.mmproj_weights(gg, _GGUF_PROJECTOR, "Audio Flamingo 3")
    return _build(args, weights, text_hidden, gg.path)


def _build(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> AudioFlamingo3Audio:
    """The encoder with `weights` (checked against its shapes), in f32."""
    widths = (args.text_hidden_size, text_hidden)
    return AudioFlamingo3Audio(with_weights(AudioFlamingo3Encoder, args, weights, source, widths))


def music_is_mmproj(path: str | Path) -> bool:
    """No mmproj holds Music Flamingo's encoder (see the module's note)."""
    return False


def music_from_mmproj(path: str | Path, text_hidden: int) -> MusicFlamingoAudio:
    """Refused: music_is_mmproj takes no file (see the module's note)."""
    raise UnsupportedError(f"{path}: llmrun takes Music Flamingo's audio from its folder")


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen2's (an Audio Flamingo 3 or Music
    Flamingo folder's text_config, or its GGUF's arch qwen2)."""
    return config.get("model_type") == "qwen2"
