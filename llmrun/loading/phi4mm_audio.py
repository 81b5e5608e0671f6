"""Phi-4-multimodal's audio encoder (NeMo subsampling, Conformer blocks, its speech MLP)
from its Hugging Face folder (Phi4MultimodalForCausalLM). llama.cpp's converter has no
Phi-4-multimodal, so the folder is the one format; the language model (Phi-3) loads as
for text (llmrun.loading.vl_text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models import phi4mm_audio

MODEL_TYPE = "phi4_multimodal"
_HF_PREFIXES = {"model.embed_tokens_extend.audio_embed.": ""}
# The projection for prompts with images too, which llmrun does not run.
_UNUSED = ("up_proj_for_vision_speech.", "down_proj_for_vision_speech.")


@dataclass
class Phi4mmAudio:
    """A loaded Phi-4-multimodal audio encoder."""

    encoder: phi4mm_audio.AudioEncoder


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a config.json is Phi-4-multimodal's with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    return has_audio(safetensors_io.read_json(path / "config.json"))


def text_takes_audio(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "phi3"


def is_mmproj(path: str | Path) -> bool:
    """No mmproj GGUF holds this encoder: llama.cpp does not convert it."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Phi4mmAudio:
    """Refused: is_mmproj takes no file."""
    raise UnsupportedError(f"{path}: llmrun takes Phi-4-multimodal's audio from its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Phi4mmAudio:
    """The audio encoder of a Phi-4-multimodal Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Phi-4-multimodal folder with an audio_config")
    text_hidden_size = config.get("hidden_size") or 3072
    args = phi4mm_audio.AudioArgs.from_config(config["audio_config"], text_hidden_size)
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _HF_PREFIXES).items()
        if not name.startswith(_UNUSED)
    }
    widths = (args.text_hidden_size, text_hidden)
    return Phi4mmAudio(with_weights(phi4mm_audio.AudioEncoder, args, weights, path, widths))
