"""What the audio encoders built on Whisper's tower (Voxtral's, Qwen2-Audio's) share at the
loader edge: their tensors in a Hugging Face folder, and in the mmproj GGUF that llama.cpp's
converter writes beside the text model's GGUF (conversion/ultravox.py WhisperEncoderModel
and its subclasses: clip.audio.* metadata, the tower's tensors as a.*, the conv biases as
[channels, 1], the projector's as mm.a.*).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading import gguf_io
from llmrun.loading.vision import mmproj_name, mmproj_tensors, with_suffixes
from llmrun.models.whisper_encoder import EncoderArgs

TEXT_ONLY = "without the audio tower"  # how the loader's note on such a folder ends
# The GGUF names of a layer's tensors (gguf-py's tensor_mapping) -> Whisper's.
GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "self_attn_layer_norm",
    "ln2": "final_layer_norm",
    "ffn_up": "fc1",
    "ffn_down": "fc2",
}
_GGUF_TOWER = {
    "a.conv1d.1": "audio_tower.conv1",
    "a.conv1d.2": "audio_tower.conv2",
    "a.position_embd": "audio_tower.embed_positions",
    "a.post_ln": "audio_tower.layer_norm",
}


def projector_type(path: str | Path) -> Any:
    """An mmproj GGUF's audio projector type (clip.audio.projector_type where a file of
    several encoders names one, else clip.projector_type)."""
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return meta.get(Keys.ClipAudio.PROJECTOR_TYPE, meta.get(Keys.Clip.PROJECTOR_TYPE))


def mmproj_args(gg: gguf_io.GGUFFile) -> EncoderArgs:
    """The encoder's settings from an mmproj GGUF's clip.audio.* metadata (the positions
    from a.position_embd's rows), which must say it holds an audio encoder."""
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
    return EncoderArgs(
        hidden_size=need(audio.EMBEDDING_LENGTH),
        intermediate_size=need(audio.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(audio.BLOCK_COUNT),
        num_attention_heads=need(audio.Attention.HEAD_COUNT),
        num_mel_bins=need(audio.NUM_MEL_BINS),
        max_source_positions=positions.shape[0],
        text_hidden_size=need(audio.PROJECTION_DIM),
        layer_norm_eps=float(meta.get(audio.Attention.LAYERNORM_EPS, 1e-5)),
    )


def mmproj_weights(
    gg: gguf_io.GGUFFile, projector: dict[str, str], family: str
) -> dict[str, torch.Tensor]:
    """Every tensor of an mmproj GGUF under the encoder's names: the tower's (a.*), and the
    projector's by `projector` (GGUF module name -> the encoder's); another is refused as
    not part of `family`'s encoder. The conv biases as the HF model has them ([channels])."""
    names = with_suffixes({**_GGUF_TOWER, **projector})

    def name_of(name: str) -> str | None:
        return mmproj_name(name, names, GGUF_LAYER, "audio_tower.layers.", tower="a")

    weights = mmproj_tensors(gg, name_of, f"{family}'s audio encoder")
    for name, tensor in weights.items():
        if name.endswith(("conv1.bias", "conv2.bias")) and tensor.dim() == 2:
            weights[name] = tensor.reshape(-1)  # [channels, 1] for ggml's broadcast
    return weights
