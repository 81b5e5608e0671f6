"""Fun-ASR-Nano's audio encoder and adaptor from its Hugging Face folder, as transformers
saves FunAsrNanoForConditionalGeneration (FunAudioLLM/Fun-ASR-Nano-2512-hf: audio_config,
adaptor_config, model.audio_tower.*, model.multi_modal_projector.*), with its feature
extractor's settings (processor_config.json's "feature_extractor" or
preprocessor_config.json, FunAsrNanoFeatureExtractor's defaults where they leave them
out). llama.cpp writes no mmproj for it: folders only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import feature_extractor, prefixed_weights, with_weights
from llmrun.models.fun_asr_nano_audio import EncoderArgs, FunAsrNanoEncoder

MODEL_TYPE = "fun_asr_nano"
_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "audio_tower.": "audio_tower.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# FunAsrNanoFeatureExtractor's settings llmrun computes, as its defaults have them.
_FIXED = {"sampling_rate": 16000, "frame_length": 25, "frame_shift": 10, "window": "hamming"}


@dataclass
class FunAsrNanoAudio:
    """A loaded Fun-ASR-Nano audio encoder, and how its feature extractor stacks frames:
    `stack` 10 ms fbank frames every `stride` make a 60 ms frame."""

    encoder: FunAsrNanoEncoder
    stack: int = 7
    stride: int = 6


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Fun-ASR-Nano folder with its audio tower's config."""
    config = safetensors_io.read_json(path / "config.json")
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def _stacking(path: Path, args: EncoderArgs) -> tuple[int, int]:
    """The feature extractor's (num_frames_lfr, stride_lfr), refusing settings llmrun
    does not compute or that disagree with the encoder's input."""
    file, values = feature_extractor(path)
    for key, expected in _FIXED.items():
        if values.get(key, expected) != expected:
            raise UnsupportedError(
                f"{file}: {key} {values[key]!r}; llmrun computes Fun-ASR-Nano's features "
                f"with {', '.join(f'{k} {v}' for k, v in _FIXED.items())}"
            )
    mel_bins = values.get("feature_size", 80)
    stack, stride = values.get("num_frames_lfr", 7), values.get("stride_lfr", 6)
    for name, value in (("num_frames_lfr", stack), ("stride_lfr", stride)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFormatError(f"{file}: {name} is {value!r}, not a positive number")
    if (mel_bins, stack) != (args.num_mel_bins, args.num_stacked_frames):
        raise ModelFormatError(
            f"{file}: {stack} frames of {mel_bins} mel bins, but the encoder takes "
            f"{args.num_stacked_frames} of {args.num_mel_bins}"
        )
    return stack, stride


def from_hf_dir(path: Path, text_hidden: int) -> FunAsrNanoAudio:
    """Fun-ASR-Nano's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != MODEL_TYPE or not isinstance(config.get("audio_config"), dict):
        raise UsageError(f"{path}: not a Fun-ASR-Nano folder with an audio_config")
    args = EncoderArgs.from_config(config)
    stack, stride = _stacking(path, args)
    weights = prefixed_weights(path, _PREFIXES)
    widths = (args.adaptor_hidden_size, text_hidden)
    return FunAsrNanoAudio(
        with_weights(FunAsrNanoEncoder, args, weights, path, widths), stack, stride
    )


def from_mmproj(path: str | Path, text_hidden: int) -> FunAsrNanoAudio:
    raise UnsupportedError(f"{path}: llama.cpp writes no mmproj for Fun-ASR-Nano's audio tower")


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Qwen3's (a Fun-ASR-Nano folder's text_config)."""
    return config.get("model_type") == "qwen3"
