"""Qwen3-Omni's image and audio encoders (its "thinker"'s towers) from either format: its
Hugging Face folder (the Hub's Qwen3OmniMoeForConditionalGeneration: thinker_config,
thinker.visual.* and thinker.audio_tower.*; or a Qwen3OmniMoeThinkerForConditionalGeneration
as transformers 5 saves it: visual.*, audio_tower.*), or the one mmproj GGUF that
llama.cpp's converter writes beside the text model's GGUF (conversion/qwen3vl.py
Qwen3OmniMmprojModel: clip.vision.projector_type qwen3vl_merger, the vision tower as
Qwen3-VL's v.*, mm.* and v.deepstack.*; clip.audio.projector_type qwen3a, the audio tower
as a.conv2d.N, a.conv_out, a.blk.*, a.post_ln and its projector as mm.a.mlp.1 and
mm.a.mlp.2). The talker and code2wav (speech output) are not run. Both formats give the
encoders HF's weights.

The vision tower is Qwen3-VL's (llmrun.models.qwen3_vl_vision), its mergers named ln_q and
mlp.0/mlp.2 and its deepstack mergers merger_list; the audio tower is
llmrun.models.qwen3_omni_audio. The mmproj holds neither the audio tower's windows
(n_window, n_window_infer) nor conv_out's width: they are the Hub's (50 and 800 frames;
clip.cpp hardcodes the 100-frame chunks and attends over the whole clip, llmrun follows
transformers' 800-frame windows) and conv_out's weight's. The converter writes the text
GGUF's n_deepstack_layers as 0 whatever the tower has; the language model adds the
tower's deepstack features as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError
from llmrun.loading import gguf_io, qwen3_vl_vision
from llmrun.loading.qwen2_5_omni import (
    AUDIO_PREFIXES,
    AUDIO_TENSORS,
    VISION_PREFIXES,
    Thinker,
    mmproj_audio_tensors,
)
from llmrun.loading.qwen2_vl_vision import processor_settings
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.qwen3_omni_audio import EncoderArgs, Qwen3OmniAudioEncoder
from llmrun.models.qwen3_vl_vision import EncoderArgs as VisionArgs
from llmrun.models.qwen3_vl_vision import VisionModel

MODEL_TYPE, THINKER_TYPE = "qwen3_omni_moe", "qwen3_omni_moe_thinker"
VISION_PROJECTOR, AUDIO_PROJECTOR = VisionProjectorType.QWEN3VL, VisionProjectorType.QWEN3A
# Qwen3-Omni's merger names -> Qwen3-VL's (the tower's).
_MERGER_PARTS = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}
# Qwen3OmniMoeAudioEncoderConfig's defaults, for a config.json that leaves some out.
_AUDIO_DEFAULTS = {
    "d_model": 1280,
    "encoder_ffn_dim": 5120,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "num_mel_bins": 128,
    "n_window": 50,
    "n_window_infer": 800,
    "downsample_hidden_size": 480,
    "output_dim": 3584,
    "activation_function": "gelu",
}
_GGUF_AUDIO = {
    "a.conv2d.1": "audio_tower.conv2d1",
    "a.conv2d.2": "audio_tower.conv2d2",
    "a.conv2d.3": "audio_tower.conv2d3",
    "a.conv_out": "audio_tower.conv_out",
    "a.post_ln": "audio_tower.ln_post",
    "mm.a.mlp.1": "audio_tower.proj1",
    "mm.a.mlp.2": "audio_tower.proj2",
}


@dataclass
class OmniVision(qwen3_vl_vision.Qwen3Vision):
    """A loaded Qwen3-Omni vision tower (Qwen3-VL's; its language model's deepstack layers
    are the tower's, whatever a text GGUF says)."""


@dataclass
class Qwen3OmniAudio:
    """A loaded Qwen3-Omni audio encoder; a clip goes in as its log-mel frames."""

    encoder: Qwen3OmniAudioEncoder


THINKER = Thinker(MODEL_TYPE, THINKER_TYPE, "Qwen3-Omni")


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Qwen3-Omni folder with its vision tower's config."""
    return THINKER.folder_has(path, "vision_config")


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Qwen3-Omni folder with its audio tower's config."""
    return THINKER.folder_has(path, "audio_config")


def _projectors(path: str | Path) -> tuple[Any, Any]:
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    return meta.get(Keys.ClipVision.PROJECTOR_TYPE), meta.get(Keys.ClipAudio.PROJECTOR_TYPE)


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is Qwen3-Omni's mmproj: Qwen3-VL's vision projector beside qwen3a
    (Qwen3-ASR's, qwen3a alone, is not taken for it)."""
    return _projectors(path) == (VISION_PROJECTOR, AUDIO_PROJECTOR)


def vision_from_hf_dir(path: Path, text_hidden: int) -> OmniVision:
    """The vision tower of a Qwen3-Omni folder (f32, on the CPU), with the image
    processor's settings of its preprocessor_config.json (Qwen3-VL's where it has none)."""
    thinker = THINKER.of_folder(path, "vision_config")
    args = VisionArgs.from_config(
        {"model_type": MODEL_TYPE, "vision_config": thinker["vision_config"]}
    )
    weights = {_vision_name(k): v for k, v in prefixed_weights(path, VISION_PREFIXES).items()}
    processor = processor_settings(
        path,
        args,
        qwen3_vl_vision.MEAN,
        qwen3_vl_vision.STD,
        qwen3_vl_vision.MIN_PIXELS,
        qwen3_vl_vision.MAX_PIXELS,
    )
    widths = (args.out_hidden_size, text_hidden)
    return OmniVision(with_weights(VisionModel, args, weights, path, widths), **processor)


def _vision_name(name: str) -> str:
    """A Qwen3-Omni tower's tensor name as Qwen3-VL's tower has it: merger.ln_q ->
    merger.norm, merger_list.N.mlp.0 -> deepstack_merger_list.N.linear_fc1, ..."""
    parts = name.split(".")
    if parts[0] == "merger_list":
        parts[0] = "deepstack_merger_list"
        head = 2
    elif parts[0] == "merger":
        head = 1
    else:
        return name
    module = ".".join(parts[head:-1])
    return ".".join([*parts[:head], _MERGER_PARTS.get(module, module), parts[-1]])


def vision_from_mmproj(path: str | Path, text_hidden: int) -> OmniVision:
    """The vision tower of llama.cpp's Qwen3-Omni mmproj (Qwen3-VL's tower beside the
    audio tower)."""
    vision = qwen3_vl_vision.from_mmproj(path, text_hidden, skip=AUDIO_TENSORS)
    return OmniVision(vision.encoder, vision.mean, vision.std, vision.min_pixels, vision.max_pixels)


def audio_from_hf_dir(path: Path, text_hidden: int) -> Qwen3OmniAudio:
    """The audio encoder of a Qwen3-Omni folder (f32, on the CPU)."""
    args = audio_args(THINKER.of_folder(path, "audio_config")["audio_config"], _AUDIO_DEFAULTS)
    return _build_audio(args, prefixed_weights(path, AUDIO_PREFIXES), text_hidden, path)


def audio_args(config: dict[str, Any], defaults: dict[str, Any]) -> EncoderArgs:
    """The audio tower's settings of its audio_config dict, `defaults` (its config class's)
    where it leaves some out (Qwen3-ASR's tower is this one under other defaults)."""
    audio = {**defaults, **config}
    return EncoderArgs(
        hidden_size=audio["d_model"],
        intermediate_size=audio["encoder_ffn_dim"],
        num_hidden_layers=audio["encoder_layers"],
        num_attention_heads=audio["encoder_attention_heads"],
        text_hidden_size=audio["output_dim"],
        num_mel_bins=audio["num_mel_bins"],
        downsample_hidden_size=audio["downsample_hidden_size"],
        n_window=audio["n_window"],
        n_window_infer=audio["n_window_infer"],
        activation_function=audio["activation_function"],
    )


def audio_from_mmproj(path: str | Path, text_hidden: int) -> Qwen3OmniAudio:
    """The audio encoder of llama.cpp's Qwen3-Omni mmproj (clip.audio.projector_type
    qwen3a; Qwen3-ASR's holds the same tower alone), its windows the Hub's (the file does
    not hold them)."""
    gg = gguf_io.read_gguf(path)
    meta, key = gg.metadata, Keys.ClipAudio
    if not meta.get(Keys.Clip.HAS_AUDIO_ENCODER, False):
        raise ModelFormatError(f"{gg.path}: not an mmproj GGUF with an audio encoder")

    def need(name: str) -> int:
        value = meta.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{gg.path}: metadata {name!r} is {value!r}")
        return value

    conv = gg.tensors.get("a.conv2d.1.weight")
    if conv is None or len(conv.shape) != 4:
        raise ModelFormatError(f"{gg.path}: no a.conv2d.1.weight of [channels, 1, 3, 3]")
    args = EncoderArgs(
        hidden_size=need(key.EMBEDDING_LENGTH),
        intermediate_size=need(key.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(key.BLOCK_COUNT),
        num_attention_heads=need(key.Attention.HEAD_COUNT),
        text_hidden_size=need(key.PROJECTION_DIM),
        num_mel_bins=need(key.NUM_MEL_BINS),
        downsample_hidden_size=conv.shape[0],
        layer_norm_eps=float(meta.get(key.Attention.LAYERNORM_EPS, 1e-5)),
    )
    weights = mmproj_audio_tensors(gg, _GGUF_AUDIO, "Qwen3-Omni's audio encoder")
    for name, tensor in weights.items():
        if name.endswith("bias") and ".conv2d" in name:
            weights[name] = tensor.reshape(-1)  # [channels, 1, 1] for ggml's broadcast
    return _build_audio(args, weights, text_hidden, gg.path)


def _build_audio(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> Qwen3OmniAudio:
    widths = (args.text_hidden_size, text_hidden)
    return Qwen3OmniAudio(with_weights(Qwen3OmniAudioEncoder, args, weights, source, widths))
