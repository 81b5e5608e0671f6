"""Voxtral's audio encoder (Whisper's tower, Voxtral's projector) from either format: its
Hugging Face folder (VoxtralForConditionalGeneration: audio_tower.*, multi_modal_projector.*,
or transformers 5's model.-prefixed names), or the mmproj GGUF that llama.cpp's converter
writes beside the text model's GGUF (conversion/ultravox.py VoxtralWhisperEncoderModel:
projector type voxtral, clip.audio.* metadata, a.* and mm.a.mlp.* tensors, the conv
biases as [channels, 1]). Both give the encoder HF's weights.

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
from llmrun.loading import gguf_io, safetensors_io
from llmrun.loading.vision import encoder_tensor, with_weights
from llmrun.models.whisper_encoder import AudioEncoder, EncoderArgs

MODEL_TYPE = "voxtral"
TEXT_ONLY = "without the audio tower"  # how the loader's note on a Voxtral folder ends
# Checkpoint key prefixes of the audio parts (the Hub's, transformers 5's) -> the encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# The GGUF names of a layer's tensors (gguf-py's tensor_mapping) -> Whisper's.
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "self_attn_layer_norm",
    "ln2": "final_layer_norm",
    "ffn_up": "fc1",
    "ffn_down": "fc2",
}
_GGUF_NAMES = {
    "a.conv1d.1": "audio_tower.conv1",
    "a.conv1d.2": "audio_tower.conv2",
    "a.position_embd": "audio_tower.embed_positions",
    "a.post_ln": "audio_tower.layer_norm",
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


def projector_type(path: str | Path) -> Any:
    """An mmproj GGUF's audio projector type (clip.audio.projector_type where a file of
    several encoders names one, else clip.projector_type)."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return meta.get(Keys.ClipAudio.PROJECTOR_TYPE, meta.get(Keys.Clip.PROJECTOR_TYPE))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj with Voxtral's audio encoder."""
    return projector_type(path) == VisionProjectorType.VOXTRAL


def from_hf_dir(path: Path, text_hidden: int) -> VoxtralAudio:
    """Voxtral's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a Voxtral folder with an audio_config")
    if not isinstance(config.get("text_config"), dict):
        raise ModelFormatError(f"{path}: a Voxtral config.json without a text_config")
    args = EncoderArgs.from_config(config)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            for old, new in _HF_PREFIXES.items():
                if name.startswith(old):
                    weights[new + name[len(old) :]] = tensor
                    break
    return _build(args, weights, text_hidden, path)


def from_mmproj(path: str | Path, text_hidden: int) -> VoxtralAudio:
    """The audio encoder of llama.cpp's mmproj GGUF (projector type voxtral)."""
    gg = gguf_io.read_gguf(path)
    meta = gg.metadata
    if not meta.get(Keys.Clip.HAS_AUDIO_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with an audio encoder")
    audio = Keys.ClipAudio

    def need(key: str) -> Any:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    positions = gg.tensors.get("a.position_embd.weight")
    if positions is None or len(positions.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no a.position_embd.weight of [positions, width]")
    width, stack = need(audio.EMBEDDING_LENGTH), need(audio.Projector.STACK_FACTOR)
    args = EncoderArgs(
        hidden_size=width,
        intermediate_size=need(audio.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(audio.BLOCK_COUNT),
        num_attention_heads=need(audio.Attention.HEAD_COUNT),
        num_mel_bins=need(audio.NUM_MEL_BINS),
        max_source_positions=positions.shape[0],
        text_hidden_size=need(audio.PROJECTION_DIM),
        layer_norm_eps=float(meta.get(audio.Attention.LAYERNORM_EPS, 1e-5)),
    )
    if args.stack != stack:
        raise UnsupportedError(
            f"{gg.path}: stack factor {stack} with an FFN of {args.intermediate_size} for "
            f"width {width}; Voxtral's projector takes intermediate_size / width frames a row"
        )
    weights = {}
    for info in gg.tensors.values():
        name = _gguf_name(info.name)
        if name is None:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r} is not part of Voxtral's audio encoder"
            )
        tensor = encoder_tensor(gg, info)
        if name.endswith(("conv1.bias", "conv2.bias")) and tensor.dim() == 2:
            tensor = tensor.reshape(-1)  # [channels, 1] for ggml's broadcast
        weights[name] = tensor
    return _build(args, weights, text_hidden, gg.path)


def _gguf_name(name: str) -> str | None:
    module, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if module in _GGUF_NAMES:
        return f"{_GGUF_NAMES[module]}.{suffix}"
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["a", "blk"] and parts[2].isdigit():
        layer = _GGUF_LAYER.get(parts[3])
        if layer is not None:
            return f"audio_tower.layers.{parts[2]}.{layer}.{suffix}"
    return None


def _build(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> VoxtralAudio:
    """The encoder with `weights` (checked against its shapes), in f32."""
    return VoxtralAudio(
        with_weights(AudioEncoder, args, weights, source, (args.text_hidden_size, text_hidden))
    )
