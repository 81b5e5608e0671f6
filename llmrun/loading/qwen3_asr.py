"""Qwen3-ASR's audio encoder from either format: its Hugging Face folder, as transformers
saves Qwen3ASRForConditionalGeneration (Qwen/Qwen3-ASR-*-hf: audio_config at the top level,
model.audio_tower.* and the projector as model.multi_modal_projector.linear_1/linear_2) or
as Qwen's own files lay it out (Qwen/Qwen3-ASR-*: thinker_config, thinker.audio_tower.* with
the projector as proj1/proj2), or the mmproj GGUF that llama.cpp's converter writes beside
the text model's GGUF (conversion/qwen3vl.py Qwen3ASRMmprojModel: clip.audio.projector_type
qwen3a and no vision tower, the tensors named as Qwen3-Omni's audio tower's).

The tower is Qwen3-Omni's (llmrun.models.qwen3_omni_audio, its projector as proj1 and
proj2), under Qwen3ASREncoderConfig's defaults; the mmproj holds its windows as Qwen3-Omni's
does not (llmrun.loading.qwen3_omni).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from llmrun.errors import UsageError
from llmrun.loading import gguf_io, qwen3_omni, safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.qwen3_omni_audio import Qwen3OmniAudioEncoder

MODEL_TYPE = "qwen3_asr"
# Qwen3ASREncoderConfig's defaults, for a config.json that leaves some out.
_AUDIO_DEFAULTS = {
    "d_model": 1024,
    "encoder_ffn_dim": 4096,
    "encoder_layers": 24,
    "encoder_attention_heads": 16,
    "num_mel_bins": 128,
    "n_window": 50,
    "n_window_infer": 800,
    "downsample_hidden_size": 480,
    "output_dim": 3584,
    "activation_function": "gelu",
}
# Both layouts' tower and projector -> Qwen3-Omni's tower's names.
_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "model.multi_modal_projector.linear_1.": "audio_tower.proj1.",
    "model.multi_modal_projector.linear_2.": "audio_tower.proj2.",
    "thinker.audio_tower.": "audio_tower.",
}


@dataclass
class Qwen3ASRAudio:
    """A loaded Qwen3-ASR audio encoder; a clip goes in as its log-mel frames."""

    encoder: Qwen3OmniAudioEncoder


def outer_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config holding the audio_config and text_config of a Qwen3-ASR config.json
    dict (its thinker_config in Qwen's own files), None for another model's."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    thinker = config.get("thinker_config")
    return thinker if isinstance(thinker, dict) else config


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Qwen3-ASR folder with its audio tower's config."""
    held = outer_config(safetensors_io.read_json(path / "config.json"))
    return held is not None and isinstance(held.get("audio_config"), dict)


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is Qwen3-ASR's mmproj: the qwen3a audio projector alone (Qwen3-Omni's
    has Qwen3-VL's vision projector beside it)."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    vision, audio = (
        meta.get(Keys.ClipVision.PROJECTOR_TYPE),
        meta.get(Keys.ClipAudio.PROJECTOR_TYPE),
    )
    return vision is None and audio == qwen3_omni.AUDIO_PROJECTOR


def from_hf_dir(path: Path, text_hidden: int) -> Qwen3ASRAudio:
    """The audio encoder of a Qwen3-ASR folder (f32, on the CPU)."""
    held = outer_config(safetensors_io.read_config(path))
    if held is None or not isinstance(held.get("audio_config"), dict):
        raise UsageError(f"{path}: not a Qwen3-ASR folder with an audio_config")
    args = qwen3_omni.audio_args(held["audio_config"], _AUDIO_DEFAULTS)
    weights = prefixed_weights(path, _PREFIXES)
    widths = (args.text_hidden_size, text_hidden)
    return Qwen3ASRAudio(with_weights(Qwen3OmniAudioEncoder, args, weights, path, widths))


def from_mmproj(path: str | Path, text_hidden: int) -> Qwen3ASRAudio:
    """The audio encoder of llama.cpp's Qwen3-ASR mmproj, read as Qwen3-Omni's audio tower."""
    return Qwen3ASRAudio(qwen3_omni.audio_from_mmproj(path, text_hidden).encoder)


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen3's (a Qwen3-ASR folder's text_config, or
    its GGUF's arch qwen3vl, Qwen3's with M-RoPE sections)."""
    return config.get("model_type") == "qwen3"
