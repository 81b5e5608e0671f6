"""GLM-ASR's audio encoder from either format: its Hugging Face folder, as transformers
saves GlmAsrForConditionalGeneration (zai-org/GLM-ASR-Nano-*: audio_config, audio_tower.*,
multi_modal_projector.*, or the same under model.), or the mmproj GGUF that llama.cpp's
converter writes of zai-org's original files beside the text model's GGUF (arch llama;
conversion/ultravox.py GlmASRWhisperEncoderModel: projector type glma, the tower's tensors
as Whisper's a.*, its final norm as mm.a.norm_pre, the projector as mm.a.mlp.1/2).

The mmproj keeps the original files' order of each head's turned rows (pairs side by
side), which transformers' converter (convert_glmasr_weights_to_hf.py permute_rope)
reorders into halves: llmrun reorders them as it does. The mmproj also holds the original's
learned positions (a.position_embd), which llama.cpp's graph adds where GLM-ASR turns
queries and keys by RoPE instead, and audio_bos_eos_token (v.boi, v.eoi), the embeddings
of <|begin_of_audio|> and <|end_of_audio|>, which the prompt holds as tokens: llmrun, as
transformers, uses neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gguf_io, safetensors_io, whisper_audio
from llmrun.loading.vision import (
    mmproj_name,
    mmproj_tensors,
    prefixed_weights,
    with_suffixes,
    with_weights,
)
from llmrun.models.glmasr_encoder import EncoderArgs, GlmAsrEncoder

MODEL_TYPE = "glmasr"
PROJECTOR = "glma"  # gguf's VisionProjectorType.GLMA
# GlmAsrConfig's text_config default width, for a config.json that leaves it out.
_TEXT_HIDDEN = 2048
# Checkpoint key prefixes of the audio parts (save_pretrained's, model.-prefixed) -> the
# encoder's.
_HF_PREFIXES = {
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# The mmproj's layer tensors (gguf-py's names) -> the tower's.
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_GGUF_MODULES = {
    "a.conv1d.1": "audio_tower.conv1",
    "a.conv1d.2": "audio_tower.conv2",
    "mm.a.norm_pre": "audio_tower.norm",
    "mm.a.mlp.1": "multi_modal_projector.linear_1",
    "mm.a.mlp.2": "multi_modal_projector.linear_2",
}
# The mmproj's tensors llmrun does not use (see the docstring).
_UNUSED = ("a.position_embd.weight", "v.boi", "v.eoi")


@dataclass
class GlmAsrAudio:
    """A loaded GLM-ASR audio encoder; a clip goes in as 30-second windows of log-mel
    features."""

    encoder: GlmAsrEncoder


def has_audio(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a GLM-ASR with its audio tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("audio_config"), dict)


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a GLM-ASR with its audio tower."""
    return has_audio(safetensors_io.read_json(path / "config.json"))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj with GLM-ASR's audio encoder."""
    return whisper_audio.projector_type(path) == PROJECTOR


def from_hf_dir(path: Path, text_hidden: int) -> GlmAsrAudio:
    """GLM-ASR's audio encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_audio(config):
        raise UsageError(f"{path}: not a GLM-ASR folder with an audio_config")
    text = config.get("text_config")
    projects_to = text.get("hidden_size", _TEXT_HIDDEN) if isinstance(text, dict) else _TEXT_HIDDEN
    args = EncoderArgs.from_config(config, projects_to)
    weights = prefixed_weights(path, _HF_PREFIXES)
    widths = (args.text_hidden_size, text_hidden)
    return GlmAsrAudio(with_weights(GlmAsrEncoder, args, weights, path, widths))


def from_mmproj(path: str | Path, text_hidden: int) -> GlmAsrAudio:
    """The audio encoder of llama.cpp's mmproj GGUF (projector type glma)."""
    gg = gguf_io.read_gguf(path)
    meta, audio = gg.metadata, Keys.ClipAudio
    if not meta.get(Keys.Clip.HAS_AUDIO_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with an audio encoder")

    def need(key: str) -> int:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {key!r} is {value!r}")
        return value

    stack = meta.get(audio.Projector.STACK_FACTOR)
    if stack != 4:
        raise ModelFormatError(
            f"{gg.path}: metadata {audio.Projector.STACK_FACTOR!r} is {stack!r}: GLM-ASR "
            "stacks 4 frames a token"
        )
    names = with_suffixes(_GGUF_MODULES)

    def name_of(name: str) -> str | None:
        if name in _UNUSED:
            return name
        return mmproj_name(name, names, _GGUF_LAYER, "audio_tower.layers.", tower="a")

    weights = mmproj_tensors(
        gg, name_of, "GLM-ASR's audio encoder", keep=lambda n: n not in _UNUSED
    )
    width, heads = need(audio.EMBEDDING_LENGTH), need(audio.Attention.HEAD_COUNT)
    key = weights.get("audio_tower.layers.0.self_attn.k_proj.weight")
    if key is None or key.dim() != 2 or key.shape[0] % (width // heads):
        raise ModelFormatError(f"{gg.path}: no a.blk.0.attn_k.weight of [kv heads x head, width]")
    args = EncoderArgs(
        hidden_size=width,
        intermediate_size=need(audio.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(audio.BLOCK_COUNT),
        num_attention_heads=heads,
        num_key_value_heads=key.shape[0] // (width // heads),
        text_hidden_size=need(audio.PROJECTION_DIM),
        num_mel_bins=need(audio.NUM_MEL_BINS),
        layer_norm_eps=float(meta.get(audio.Attention.LAYERNORM_EPS, 1e-5)),
    )
    order = _halves_order(args)
    for name, tensor in weights.items():
        if name.endswith(("conv1.bias", "conv2.bias")) and tensor.dim() == 2:
            weights[name] = tensor.reshape(-1)  # [channels, 1] for ggml's broadcast
        elif ".q_proj." in name or ".k_proj." in name:
            weights[name] = tensor[order[: len(tensor)]]
    widths = (args.text_hidden_size, text_hidden)
    return GlmAsrAudio(with_weights(GlmAsrEncoder, args, weights, gg.path, widths))


def _halves_order(args: EncoderArgs) -> torch.Tensor:
    """Rows of q (or k, its first rows) in transformers' order: row i is the original's
    order[i], each head's turned part as its even then its odd rows, the rest as it was."""
    head, turned = args.head_dim, args.rotary_dim
    within = torch.cat(
        [torch.arange(0, turned, 2), torch.arange(1, turned, 2), torch.arange(turned, head)]
    )
    return torch.cat([h * head + within for h in range(args.num_attention_heads)])


def text_takes_audio(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Llama's (a GLM-ASR folder's text_config, or
    its GGUF's arch llama)."""
    return config.get("model_type") == "llama"
