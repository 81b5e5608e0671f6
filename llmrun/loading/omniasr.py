"""OmniASR's audio encoder from its Hugging Face folder, as transformers saves
OmniASRForConditionalGeneration (hf-audio/omniasr-llm-*: audio_config, the tower as
model.audio_tower.*, the projector as model.multi_modal_projector.*, or the same without
model.), and what `show` says of a CTC folder (OmniASRForCTC, which the loader builds as
llmrun.models.omniasr_ctc). llama.cpp converts no OmniASR, so there is no mmproj of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.omniasr_audio import EncoderArgs, OmniASREncoder

MODEL_TYPE = "omniasr"
CTC = "omniasr_ctc"  # OmniASRForCTC (llmrun.models.omniasr_ctc)
# OmniASRConfig's text_config default width, for a config.json that leaves it out.
_TEXT_HIDDEN = 4096
# Checkpoint key prefixes of the audio parts (save_pretrained's, model.-prefixed) -> the
# encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


@dataclass
class OmniASRAudio:
    """A loaded OmniASR audio encoder; a clip goes in as its normalized samples."""

    encoder: OmniASREncoder


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of an OmniASR with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of an OmniASR with its audio tower."""
    return has_audio(safetensors_io.read_json(path / "config.json"))


def from_hf_dir(path: Path, text_hidden: int) -> OmniASRAudio:
    """OmniASR's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not an OmniASR folder with an audio_config")
    text = config.get("text_config")
    projects_to = text.get("hidden_size", _TEXT_HIDDEN) if isinstance(text, dict) else _TEXT_HIDDEN
    args = EncoderArgs.from_config(config["audio_config"], projects_to)
    weights = prefixed_weights(path, _HF_PREFIXES)
    widths = (args.text_hidden_size, text_hidden)
    return OmniASRAudio(with_weights(OmniASREncoder, args, weights, path, widths))


def from_mmproj(path: str | Path, text_hidden: int) -> OmniASRAudio:
    raise UnsupportedError(f"{path}: llama.cpp writes no mmproj for OmniASR's audio encoder")


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Llama's (an OmniASR folder's text_config)."""
    return config.get("model_type") == "llama"


def hf_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of an OmniASR CTC folder: CTC speech recognition, its layers."""
    if config.get("model_type") != CTC:
        return {}
    audio = config.get("audio_config")
    layers = audio.get("num_hidden_layers", 24) if isinstance(audio, dict) else 24
    return {
        "speech_recognition": (
            f"speech recognition: {layers} encoder layers and a CTC head over raw 16 kHz audio"
        ),
        "context_length": None,
        "embedding_model": False,
    }
