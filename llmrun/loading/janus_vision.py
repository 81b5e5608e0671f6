"""Janus-Pro's image encoder (llmrun.models.janus_vision) from either format: the Hugging
Face folder of a JanusForConditionalGeneration (model.vision_model.* and model.aligner.*)
with its image processor's and processor's settings, or the mmproj GGUF that llama.cpp's
converter writes (conversion/januspro.py; tools/mtmd/clip.cpp reads it): projector type
janus_pro, SigLIP's tensor names, the aligner as mm.0, mm.1, ... Both give the encoder HF's
weights. The image-generation half's tensors (model.vqmodel., model.generation_*.) are
never read: the folder's are skipped by name, and the converter writes none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    image_processor,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    positive_int,
    projector_type,
    three_floats,
    with_suffixes,
    with_weights,
)
from llmrun.models import siglip
from llmrun.models.janus_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "janus"
# JanusImageProcessor's defaults: OpenAI CLIP's mean and std (Janus-Pro's files say 0.5),
# the shorter side at least 14 pixels, bicubic.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_SIZE = 14
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
_HF_PREFIXES = {"model.vision_model.": "vision_model.", "model.aligner.": "aligner."}
_GGUF_NAMES = {
    **with_suffixes(
        {
            "v.patch_embd": "vision_model.embeddings.patch_embedding",
            "v.post_ln": "vision_model.post_layernorm",
        }
    ),
    "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
}
_LAYERS = "vision_model.encoder.layers."


@dataclass
class JanusVision:
    """A loaded Janus-Pro image encoder and how images are prepared for it
    (JanusImageProcessor's settings; JanusProcessor's default system prompt, which it puts
    before a text where use_default_system_prompt says so)."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_size: int = MIN_SIZE
    resample: int = BICUBIC
    system_prompt: bool = False

    @property
    def image_size(self) -> int:
        return self.encoder.args.vision.image_size

    @property
    def background(self) -> tuple[int, ...]:
        """The colour an image is padded to a square with: the mean's, in 0..255."""
        return tuple(int(m * 255) for m in self.mean)


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Janus-Pro with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def is_mmproj(path: str | Path) -> bool:
    """Whether an mmproj GGUF's projector is Janus-Pro's."""
    return projector_type(path) == VisionProjectorType.JANUS_PRO


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Janus-Pro's kind: a Llama."""
    return config.get("model_type") == "llama"


def from_hf_dir(path: Path, text_hidden: int) -> JanusVision:
    """Janus-Pro's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise ModelFormatError(f"{path}: not a Janus-Pro folder with a vision_config")
    args = EncoderArgs.from_config(config)
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name)
            if new is not None:
                weights[new] = tensor
    settings = processor_settings(path, args.vision.image_size, args.tokens_per_image)
    return _build(args, weights, text_hidden, path, **settings)


def _hf_name(name: str) -> str | None:
    """The encoder's name of a checkpoint tensor; None for every other part's."""
    for old, new in _HF_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :].replace(".projection_layer.", ".out_proj.")
    return None


def processor_settings(path: Path, side: int, tokens: int) -> dict[str, Any]:
    """JanusImageProcessor's settings (its defaults where the folder gives none), refused
    where they would not make the tower's square images of `side` pixels; JanusProcessor's
    use_default_system_prompt, and its num_image_tokens checked against the tower's
    `tokens` an image."""
    file, settings = image_processor(path)
    size = settings.get("size", {"height": 384, "width": 384})
    if size != {"height": side, "width": side} or settings.get("do_pad", True) is not True:
        raise UnsupportedError(
            f"{file}: images of size {size!r} (do_pad {settings.get('do_pad', True)!r}); the "
            f"vision tower takes {side}x{side}, padded square"
        )
    min_size, resample = settings.get("min_size", MIN_SIZE), settings.get("resample", BICUBIC)
    if not positive_int(min_size) or min_size > side:
        raise ModelFormatError(f"{file}: min_size is {min_size!r}")
    if resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter")
    processor = _processor_config(path)
    count = processor.get("num_image_tokens", tokens)
    if count != tokens:
        raise ModelFormatError(
            f"{path / 'processor_config.json'}: num_image_tokens is {count!r}, but the "
            f"vision tower makes {tokens} an image"
        )
    return dict(
        mean=three_floats(settings.get("image_mean", CLIP_MEAN), file, "image_mean"),
        std=three_floats(settings.get("image_std", CLIP_STD), file, "image_std"),
        min_size=min_size,
        resample=resample,
        system_prompt=processor.get("use_default_system_prompt", False) is True,
    )


def _processor_config(path: Path) -> dict[str, Any]:
    """processor_config.json's settings, as transformers 5's JanusProcessor saves them."""
    file = path / "processor_config.json"
    if not file.is_file():
        return {}
    try:
        settings = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
    return settings if isinstance(settings, dict) else {}


def from_mmproj(path: str | Path, text_hidden: int) -> JanusVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type janus_pro). clip.cpp
    pads with grey 127 (the mean 0.5's colour) and resizes bicubically; llmrun prepares the
    image as JanusImageProcessor with the file's mean and std."""
    gg, need = open_mmproj(path, VisionProjectorType.JANUS_PRO)
    meta = gg.metadata
    vision = Keys.ClipVision
    if meta.get(vision.USE_SILU):
        act = "silu"
    elif meta.get(vision.USE_GELU):
        act = "gelu"
    else:
        raise UnsupportedError(f"{gg.path}: neither GELU nor SiLU: not Janus-Pro's tower")
    depth = 0
    while f"mm.{depth}.weight" in gg.tensors:
        depth += 1
    first = gg.tensors.get("mm.0.weight")
    if first is None or len(first.shape) != 2:
        raise ModelFormatError(f"{gg.path}: no 2-D mm.0.weight: not Janus-Pro's aligner")
    tower = siglip.VisionArgs(
        hidden_size=need(vision.EMBEDDING_LENGTH),
        intermediate_size=need(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=need(vision.BLOCK_COUNT),
        num_attention_heads=need(vision.Attention.HEAD_COUNT),
        image_size=need(vision.IMAGE_SIZE),
        patch_size=need(vision.PATCH_SIZE),
        layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        hidden_act=act,
    )
    # [out, in], as a Linear's: mm.0's rows are the aligner's width.
    args = EncoderArgs(tower, first.shape[0], depth, act)
    weights = mmproj_tensors(gg, _gguf_name, "Janus-Pro's encoder")
    mean = three_floats(meta.get(vision.IMAGE_MEAN, CLIP_MEAN), gg.path, vision.IMAGE_MEAN)
    std = three_floats(meta.get(vision.IMAGE_STD, CLIP_STD), gg.path, vision.IMAGE_STD)
    return _build(args, weights, text_hidden, gg.path, mean=mean, std=std)


def _gguf_name(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "mm" and parts[1].isdigit():
        index = int(parts[1])
        module = "aligner.fc1" if index == 0 else f"aligner.hidden_layers.{index - 1}"
        return f"{module}.{parts[2]}" if parts[2] in ("weight", "bias") else None
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, _LAYERS)


def _build(
    args: EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> JanusVision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    encoder = with_weights(ImageEncoder, args, weights, source, (args.projection_dim, text_hidden))
    return JanusVision(encoder, **settings)
