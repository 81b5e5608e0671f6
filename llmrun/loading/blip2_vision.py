"""BLIP-2's and InstructBLIP's image encoder (llmrun.models.blip2_vision) from the Hugging
Face folder of a Blip2ForConditionalGeneration (model_type blip-2, a decoder-only language
model such as OPT) or an InstructBlipForConditionalGeneration (instructblip, Vicuna's
Llama): vision_model.*, query_tokens, qformer.*, language_projection.*, BlipImageProcessor's
settings, and InstructBLIP's Q-Former tokenizer (the folder's qformer_tokenizer/, as
InstructBlipProcessor saves it). Older files keep each attention's q_bias and v_bias, which
become the fused qkv bias (zero for the keys) as Blip2Attention builds it. Folders only:
llama.cpp has no converter for BLIP-2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.janus_vision import BICUBIC, CLIP_MEAN, CLIP_STD  # BlipImageProcessor's too
from llmrun.loading.vision import image_processor, positive_int, three_floats, with_weights
from llmrun.models.blip2_vision import EncoderArgs, ImageEncoder, QFormerArgs, VisionArgs
from llmrun.tokenizer import Tokenizer, load_tokenizer

MODEL_TYPE = "blip-2"
INSTRUCTBLIP = "instructblip"
_PREFIXES = ("vision_model.", "qformer.", "language_projection.")
_SPLIT_BIAS = re.compile(r"^(vision_model\.encoder\.layers\.\d+\.self_attn\.)([qv])_bias$")


@dataclass
class Blip2Vision:
    """A loaded BLIP-2 image encoder and BlipImageProcessor's settings for it."""

    encoder: ImageEncoder
    image_token_id: int  # the config's image_token_index: the id the image's tokens take
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int

    @property
    def image_size(self) -> int:
        return self.encoder.args.vision.image_size


@dataclass
class InstructBlipVision(Blip2Vision):
    """A loaded InstructBLIP image encoder: BLIP-2's, its Q-Former reading the prompt in
    its own tokenizer's ids."""

    qformer_tokenizer: Tokenizer


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a BLIP-2 with its vision config."""
    return _is(path, MODEL_TYPE)


def instructblip_folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an InstructBLIP with its vision config."""
    return _is(path, INSTRUCTBLIP)


def _is(path: Path, model_type: str) -> bool:
    config = safetensors_io.read_config(path)
    return config.get("model_type") == model_type and isinstance(config.get("vision_config"), dict)


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no BLIP-2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Blip2Vision:
    """Refused: there is no BLIP-2 (or InstructBLIP) mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no BLIP-2 projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is one BLIP-2's images go to: BLIP-2's OPT,
    InstructBLIP's Vicuna (a Llama); the Flan-T5 ones are encoder-decoders."""
    return config.get("model_type") in ("opt", "llama")


def _pick(cls: type, settings: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in settings.items() if k in names and v is not None})


def encoder_args(config: dict[str, Any], text_hidden: int) -> EncoderArgs:
    """The encoder's shape from a Blip2Config dict (its sub-configs' defaults where they
    leave fields out); refuses what llmrun's encoder does not compute."""
    if config.get("use_decoder_only_language_model", True) is not True:
        raise UnsupportedError("a BLIP-2 with an encoder-decoder language model (Flan-T5)")
    vision, qformer = config.get("vision_config") or {}, config.get("qformer_config") or {}
    if vision.get("qkv_bias", True) is not True:
        raise UnsupportedError("a BLIP-2 vision tower without q and v biases (qkv_bias)")
    reads_text = config.get("model_type") == INSTRUCTBLIP
    if not reads_text and qformer.get("use_qformer_text_input", False):
        raise UnsupportedError("a BLIP-2 Q-Former that reads the prompt (use_qformer_text_input)")
    queries = config.get("num_query_tokens", 32)
    if not positive_int(queries):
        raise ModelFormatError(f"BLIP-2 num_query_tokens is {queries!r}")
    qformer_args = _pick(QFormerArgs, {**qformer, "reads_text": reads_text})
    return EncoderArgs(_pick(VisionArgs, vision), qformer_args, queries, text_hidden)


def from_hf_dir(path: Path, text_hidden: int) -> Blip2Vision:
    """BLIP-2's image encoder from its Hugging Face folder (f32, on the CPU)."""
    if not folder_has_vision(path):
        raise ModelFormatError(f"{path}: not a BLIP-2 folder with a vision_config")
    return _load(path, text_hidden)


def instructblip_from_hf_dir(path: Path, text_hidden: int) -> InstructBlipVision:
    """InstructBLIP's image encoder and Q-Former tokenizer from its Hugging Face folder."""
    if not instructblip_folder_has_vision(path):
        raise ModelFormatError(f"{path}: not an InstructBLIP folder with a vision_config")
    folder = path / "qformer_tokenizer"
    if not (folder / "tokenizer.json").is_file():
        raise ModelFormatError(
            f"{folder}: no tokenizer.json; InstructBLIP's Q-Former reads the prompt in its "
            "own tokenizer's ids (InstructBlipProcessor saves it there)"
        )
    loaded = _load(path, text_hidden)
    return InstructBlipVision(**vars(loaded), qformer_tokenizer=load_tokenizer(folder))


def _load(path: Path, text_hidden: int) -> Blip2Vision:
    """The encoder of a BLIP-2 or InstructBLIP folder and its image processor's settings."""
    config = safetensors_io.read_config(path)
    args = encoder_args(config, text_hidden)
    token = config.get("image_token_index", config.get("image_token_id"))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ModelFormatError(f"{path}: BLIP-2's image_token_index is {token!r}")
    weights: dict[str, torch.Tensor] = {}
    split: dict[str, dict[str, torch.Tensor]] = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            bias = _SPLIT_BIAS.match(name)
            if bias:
                split.setdefault(bias[1], {})[bias[2]] = tensor
            elif name == "query_tokens" or name.startswith(_PREFIXES):
                weights[name] = tensor
    for layer, parts in split.items():
        if set(parts) != {"q", "v"}:
            raise ModelFormatError(
                f"{path}: {layer}q_bias without v_bias, or v_bias without q_bias"
            )
        q, v = parts["q"], parts["v"]
        weights[layer + "qkv.bias"] = torch.cat([q, torch.zeros_like(v), v])
    encoder = with_weights(ImageEncoder, args, weights, path, (text_hidden, text_hidden))
    return Blip2Vision(encoder, token, **_processor_settings(path, args))


def _processor_settings(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """BlipImageProcessor's settings (its defaults where the folder gives none), refused
    where they would not make the tower's square images."""
    file, settings = image_processor(path)
    side = args.vision.image_size
    size = settings.get("size", {"height": side, "width": side})
    if size != {"height": side, "width": side} or settings.get("do_resize", True) is not True:
        raise UnsupportedError(
            f"{file}: images of size {size!r}; the vision tower takes {side}x{side}"
        )
    resample = settings.get("resample", BICUBIC)
    if resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter")
    return dict(
        mean=three_floats(settings.get("image_mean", CLIP_MEAN), file, "image_mean"),
        std=three_floats(settings.get("image_std", CLIP_STD), file, "image_std"),
        resample=resample,
    )
