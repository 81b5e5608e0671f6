"""Nemotron 3 Nano Omni's audio encoder (Parakeet's FastConformer and the projector:
llmrun.models.parakeet_encoder) from its Hugging Face folder (model_type nemotron_h_omni
or the Hub's NemotronH_Nano_Omni_Reasoning_V3): its audio_config (the Hub's sound_config)
under ParakeetEncoderConfig's names and defaults, with the Omni's own (no attention bias,
no input scaling) where it names none, as transformers reads it; tensors under the Hub's
names (sound_encoder.encoder.*, sound_projection.{norm,linear1,linear2}), which
transformers' conversion mapping renames. The checkpoint's own featurizer buffers
(sound_encoder.encoder.feature_extractor.*) are not read: the mel features are the feature
extractor's (llmrun.nemotron_omni_clips), with ParakeetFeatureExtractor's settings and
audio_config's num_mel_bins.

llama.cpp's converter writes this tower into the `parakeet` mmproj only beside Nemotron
Nano 12B v2 VL's vision projector (see llmrun.loading.nemotron_omni_vision): no mmproj is
taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.nemotron_omni_vision import MODEL_TYPES, TEXT_MODEL_TYPE
from llmrun.loading.vision import positive_int, with_weights
from llmrun.models.parakeet_encoder import AudioEncoder, EncoderArgs

# ParakeetEncoderConfig's sizes and their defaults.
_SIZES = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    intermediate_size=4096,
    num_mel_bins=80,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=256,
    subsampling_conv_kernel_size=3,
    subsampling_conv_stride=2,
)
# Its switches, and their defaults for the Omni's audio_config.
_FLAGS = dict(attention_bias=False, convolution_bias=True, scale_input=False)
_TOWER = "sound_encoder.encoder."
_PROJECTION = {
    "sound_projection.norm.": "embed_audio.layer_norm.",
    "sound_projection.linear1.": "embed_audio.linear_1.",
    "sound_projection.linear2.": "embed_audio.linear_2.",
}
# What transformers does not load: the checkpoint's featurizer, batch norms' counts.
_UNUSED = (_TOWER + "feature_extractor.",)


def _audio_config(config: dict[str, Any]) -> Any:
    return config.get("audio_config", config.get("sound_config"))


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Nemotron 3 Nano Omni with its audio
    tower."""
    file = path / "config.json"
    if not (path.is_dir() and file.is_file()):
        return False
    config = safetensors_io.read_json(file)
    return config.get("model_type") in MODEL_TYPES and isinstance(_audio_config(config), dict)


def is_mmproj(path: str | Path) -> bool:
    """No mmproj holds the Omni's audio tower beside its own images (see the module's note)."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> AudioEncoder:
    """Refused: is_mmproj takes no file (see the module's note)."""
    raise UnsupportedError(f"{path}: llmrun takes Nemotron 3 Nano Omni's audio from its folder")


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Nemotron-H's, which the Omni's text is."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The encoder's shape from a Nemotron 3 Nano Omni config.json."""
    audio = _audio_config(config)
    text = config.get("text_config", config.get("llm_config"))
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a Nemotron 3 Nano Omni config without its text width")
    values: dict[str, Any] = {}
    for name, default in _SIZES.items():
        values[name] = audio.get(name, default)
        if not positive_int(values[name]):
            raise ModelFormatError(f"{path}: audio_config.{name} is {values[name]!r}")
    for name, default in _FLAGS.items():
        values[name] = bool(audio.get(name, default))
    # transformers reads the projector's width and bias from audio_config, without defaults.
    hidden = audio.get("projection_hidden_size")
    if not positive_int(hidden) or not isinstance(audio.get("projection_bias"), bool):
        raise ModelFormatError(
            f"{path}: audio_config has no projection_hidden_size and projection_bias"
        )
    if audio.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"{path}: audio hidden_act {audio['hidden_act']!r} (silu runs)")
    heads = audio.get("num_key_value_heads", values["num_attention_heads"])
    if heads != values["num_attention_heads"]:
        raise UnsupportedError(f"{path}: audio num_key_value_heads {heads!r} (llmrun runs MHA)")
    try:
        return EncoderArgs(
            **values,
            out_hidden_size=text["hidden_size"],
            projection_hidden_size=hidden,
            projection_bias=audio["projection_bias"],
        )
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None


def from_hf_dir(path: Path, text_hidden: int) -> AudioEncoder:
    """The audio encoder of a Nemotron 3 Nano Omni folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") not in MODEL_TYPES or not isinstance(_audio_config(config), dict):
        raise UsageError(f"{path}: not a Nemotron 3 Nano Omni folder with an audio_config")
    args = encoder_args(config, path)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _name(name)
            if new is not None:
                weights[new] = tensor
            elif name.startswith(("sound_", _TOWER)) and not name.startswith(_UNUSED):
                raise UnsupportedError(
                    f"{path}: tensor {name!r} is not part of Nemotron 3 Nano Omni's audio tower"
                )
    # A batch norm's count of training batches means nothing to inference.
    for layer in range(args.num_hidden_layers):
        tracked = f"audio_tower.layers.{layer}.conv.norm.num_batches_tracked"
        weights.setdefault(tracked, torch.tensor(0))
    return with_weights(AudioEncoder, args, weights, path, (args.out_hidden_size, text_hidden))


def _name(name: str) -> str | None:
    if name.startswith(_TOWER) and not name.startswith(_UNUSED):
        return "audio_tower." + name[len(_TOWER) :]
    for old, new in _PROJECTION.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return None
