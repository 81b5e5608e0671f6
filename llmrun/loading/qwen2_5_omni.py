"""Qwen2.5-Omni's image and audio encoders (its "thinker"'s towers) from either format:
its Hugging Face folder (the Hub's Qwen2_5OmniModel: thinker_config, thinker.visual.* and
thinker.audio_tower.*; or a Qwen2_5OmniThinkerForConditionalGeneration as transformers 5
saves it: model.visual.*, model.audio_tower.*), or the one mmproj GGUF that llama.cpp's
converter writes beside the text model's GGUF (conversion/qwenvl.py Qwen25OmniModel:
projector type qwen2.5o, the vision tower as Qwen2.5-VL's v.* and mm.*, the audio tower as
Qwen2-Audio's a.* with ln_post as a.post_ln and proj as mm.a.fc). The talker and token2wav
(speech output) are not run. Both formats give the encoders HF's weights.

The vision tower is Qwen2.5-VL's (llmrun.models.qwen2_vl_vision; its checkpoint's q, k and
v are one qkv here); the audio tower is llmrun.models.qwen2_5_omni_audio. clip.cpp runs
the audio as Qwen2-Audio's, attending over whole 30-second chunks; llmrun follows
transformers (2-second windows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gguf_io, qwen2_vl_vision, safetensors_io, whisper_audio
from llmrun.loading.vision import mmproj_name, mmproj_tensors, prefixed_weights, with_weights
from llmrun.models import qwen2_vl_vision as vision_model
from llmrun.models.qwen2_5_omni_audio import EncoderArgs, Qwen25OmniAudioEncoder

MODEL_TYPE, THINKER_TYPE = "qwen2_5_omni", "qwen2_5_omni_thinker"
PROJECTOR = VisionProjectorType.QWEN25O
# The Hub's feature extractor's chunk_length (WhisperFeatureExtractor's default is 30).
MAX_SECONDS = 300
# An mmproj's audio tensors, beside the vision tower's.
AUDIO_TENSORS = ("a.", "mm.a.")
# A folder's tower tensors (the Hub's thinker.*, or a thinker's own file) -> the encoders'
# names; Qwen3-Omni's folders are laid out alike.
VISION_PREFIXES = {"thinker.visual.": "", "model.visual.": "", "visual.": ""}
AUDIO_PREFIXES = {
    "thinker.audio_tower.": "audio_tower.",
    "model.audio_tower.": "audio_tower.",
    "audio_tower.": "audio_tower.",
}
# Qwen2_5OmniAudioEncoderConfig's defaults, for a config.json that leaves some out.
_AUDIO_DEFAULTS = {
    "d_model": 1280,
    "encoder_ffn_dim": 5120,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "n_window": 100,
    "output_dim": 3584,
    "activation_function": "gelu",
}
# The learned start/end embeddings transformers keeps but never uses (llama.cpp drops them).
_UNUSED_AUDIO = "audio_tower.audio_bos_eos_token.weight"
_GGUF_AUDIO = {
    "a.conv1d.1": "audio_tower.conv1",
    "a.conv1d.2": "audio_tower.conv2",
    "a.post_ln": "audio_tower.ln_post",
    "mm.a.fc": "audio_tower.proj",
}


@dataclass
class OmniVision(qwen2_vl_vision.QwenVision):
    """A loaded Qwen2.5-Omni vision tower (Qwen2.5-VL's; its prompts mark images otherwise)."""


@dataclass
class Qwen25OmniAudio:
    """A loaded Qwen2.5-Omni audio encoder; a clip goes in as the log-mel frames its audio
    reaches, and may be `max_seconds` long (its feature extractor's chunk_length, which
    cuts what is longer)."""

    encoder: Qwen25OmniAudioEncoder
    max_seconds: int = MAX_SECONDS


@dataclass(frozen=True)
class Thinker:
    """Where an Omni model's config.json keeps its thinker's config (the towers' configs
    among it): under thinker_config of a `model_type` config, or a `thinker_type` config
    itself (a thinker's own file)."""

    model_type: str
    thinker_type: str
    family: str

    def config(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The thinker's config of a config.json dict, None for another model's."""
        if config.get("model_type") == self.model_type:
            thinker = config.get("thinker_config")
            return thinker if isinstance(thinker, dict) else None
        return config if config.get("model_type") == self.thinker_type else None

    def folder_has(self, path: Path, tower: str) -> bool:
        """Whether `path` is a folder of this model with its `tower`'s config."""
        file = path / "config.json"
        if not (path.is_dir() and file.is_file()):
            return False
        thinker = self.config(safetensors_io.read_json(file))
        return thinker is not None and isinstance(thinker.get(tower), dict)

    def of_folder(self, path: Path, tower: str) -> dict[str, Any]:
        """The thinker's config of the folder `path`, refused without its `tower`'s."""
        thinker = self.config(safetensors_io.read_config(path))
        if thinker is None or not isinstance(thinker.get(tower), dict):
            raise UsageError(f"{path}: not a {self.family} folder with a {tower}")
        return thinker


THINKER = Thinker(MODEL_TYPE, THINKER_TYPE, "Qwen2.5-Omni")


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Qwen2.5-Omni folder with its vision tower's config."""
    return THINKER.folder_has(path, "vision_config")


def folder_has_audio(path: Path) -> bool:
    """Whether `path` is a Qwen2.5-Omni folder with its audio tower's config."""
    return THINKER.folder_has(path, "audio_config")


def _mmproj_holds(path: str | Path, key: str) -> bool:
    meta = gguf_io.read_gguf(path, with_tensors=False).metadata
    kind = meta.get(Keys.Clip.PROJECTOR_TYPE)
    return kind == PROJECTOR and bool(meta.get(key, False))


def is_vision_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is Qwen2.5-Omni's mmproj with its vision encoder."""
    return _mmproj_holds(path, Keys.Clip.HAS_VISION_ENCODER)


def is_audio_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is Qwen2.5-Omni's mmproj with its audio encoder."""
    return _mmproj_holds(path, Keys.Clip.HAS_AUDIO_ENCODER)


def vision_from_hf_dir(path: Path, text_hidden: int) -> OmniVision:
    """The vision tower of a Qwen2.5-Omni folder (f32, on the CPU), with the image
    processor's settings of its preprocessor_config.json."""
    thinker = THINKER.of_folder(path, "vision_config")
    config = {"model_type": vision_model.QWEN2_5_VL, "vision_config": thinker["vision_config"]}
    args = vision_model.EncoderArgs.from_config(config)
    weights = _fused_qkv(prefixed_weights(path, VISION_PREFIXES), path)
    processor = qwen2_vl_vision.processor_settings(path, args)
    widths = (args.out_hidden_size, text_hidden)
    encoder = with_weights(vision_model.VisionModel, args, weights, path, widths)
    return OmniVision(encoder, **processor)


def _fused_qkv(weights: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """The tower's weights with each block's attn.q, attn.k and attn.v as one attn.qkv
    (Qwen2.5-VL's layout)."""
    out, parts = {}, {}
    for name, tensor in weights.items():
        stem, _, suffix = name.rpartition(".")
        block, _, kind = stem.rpartition(".")
        if block.endswith(".attn") and kind in ("q", "k", "v"):
            parts.setdefault(f"{block}.qkv.{suffix}", {})[kind] = tensor
        else:
            out[name] = tensor
    for name, pieces in parts.items():
        if set(pieces) != {"q", "k", "v"}:
            raise ModelFormatError(f"{source}: {name} lacks some of q, k and v")
        out[name] = torch.cat([pieces["q"], pieces["k"], pieces["v"]])
    return out


def vision_from_mmproj(path: str | Path, text_hidden: int) -> OmniVision:
    """The vision tower of llama.cpp's Qwen2.5-Omni mmproj (projector type qwen2.5o)."""
    vision = qwen2_vl_vision.from_mmproj(path, text_hidden, skip=AUDIO_TENSORS)
    return OmniVision(**{f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)})


def audio_from_hf_dir(path: Path, text_hidden: int) -> Qwen25OmniAudio:
    """The audio encoder of a Qwen2.5-Omni folder (f32, on the CPU)."""
    audio = {**_AUDIO_DEFAULTS, **THINKER.of_folder(path, "audio_config")["audio_config"]}
    args = EncoderArgs(
        hidden_size=audio["d_model"],
        intermediate_size=audio["encoder_ffn_dim"],
        num_hidden_layers=audio["encoder_layers"],
        num_attention_heads=audio["encoder_attention_heads"],
        num_mel_bins=audio["num_mel_bins"],
        max_source_positions=audio["max_source_positions"],
        text_hidden_size=audio["output_dim"],
        activation_function=audio["activation_function"],
        n_window=audio["n_window"],
    )
    weights = prefixed_weights(path, AUDIO_PREFIXES)
    weights.pop(_UNUSED_AUDIO, None)
    encoder = _build_audio(args, weights, text_hidden, path)
    encoder.max_seconds = _chunk_length(path)
    return encoder


def _chunk_length(path: Path) -> int:
    """The seconds a clip may last: the folder's preprocessor_config.json chunk_length
    (WhisperFeatureExtractor's 30 where it names none), or the Hub's 300 without one."""
    file = path / "preprocessor_config.json"
    if not file.is_file():
        return MAX_SECONDS
    seconds = safetensors_io.read_json(file).get("chunk_length", 30)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 1:
        raise ModelFormatError(f"{file}: chunk_length is {seconds!r}")
    return seconds


def audio_from_mmproj(path: str | Path, text_hidden: int) -> Qwen25OmniAudio:
    """The audio encoder of llama.cpp's Qwen2.5-Omni mmproj (projector type qwen2.5o), its
    windows of Qwen2_5OmniAudioEncoderConfig's default n_window (which the file does not
    hold)."""
    gg = gguf_io.read_gguf(path)
    args = EncoderArgs(**dataclasses.asdict(whisper_audio.mmproj_args(gg)))
    weights = mmproj_audio_tensors(gg, _GGUF_AUDIO, "Qwen2.5-Omni's audio encoder")
    for name, tensor in weights.items():
        if name.endswith(("conv1.bias", "conv2.bias")) and tensor.dim() == 2:
            weights[name] = tensor.reshape(-1)  # [channels, 1] for ggml's broadcast
    return _build_audio(args, weights, text_hidden, gg.path)


def mmproj_audio_tensors(
    gg: gguf_io.GGUFFile, modules: dict[str, str], what: str
) -> dict[str, torch.Tensor]:
    """An Omni mmproj's audio tower tensors (`what`) under the encoder's names: its
    `modules` (mmproj module -> encoder module) and Whisper's blocks; the vision tower's and
    the converter's sinusoid table left out."""
    names = {
        f"{module}.{suffix}": f"{new}.{suffix}"
        for module, new in modules.items()
        for suffix in ("weight", "bias")
    }

    def name_of(name: str) -> str | None:
        if not name.startswith(AUDIO_TENSORS):
            return f"vision:{name}"  # the vision tower's, left to vision_from_mmproj
        if name == "a.position_embd.weight":
            return "positions"  # the converter's sinusoid table, which the encoder computes
        return mmproj_name(name, names, whisper_audio.GGUF_LAYER, "audio_tower.layers.", tower="a")

    def keep(name: str) -> bool:
        return name.startswith("audio_tower.")

    return mmproj_tensors(gg, name_of, what, keep)


def _build_audio(
    args: EncoderArgs, weights: dict[str, torch.Tensor], text_hidden: int, source: Path
) -> Qwen25OmniAudio:
    widths = (args.text_hidden_size, text_hidden)
    return Qwen25OmniAudio(with_weights(Qwen25OmniAudioEncoder, args, weights, source, widths))
