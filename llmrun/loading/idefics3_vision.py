"""SmolVLM's and Idefics3's image encoder (SigLIP tower, pixel-shuffle connector) from
either format: its Hugging Face folder (SmolVLMForConditionalGeneration or
Idefics3ForConditionalGeneration, whose preprocessor_config.json says how images are
resized and tiled), or the mmproj GGUF that llama.cpp's converter writes beside the text
model's GGUF (conversion/smolvlm.py: projector type idefics3, the tile size as the
tower's image_size, the longest edge as clip.vision.preproc_image_size). Both give the
encoder HF's weights; the language model (Llama) loads as for text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    mmproj_name,
    mmproj_tensors,
    open_mmproj,
    prefixed_weights,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models import idefics3_vision, siglip

MODEL_TYPES = ("smolvlm", "idefics3")
# SmolVLMImageProcessor's (and Idefics3ImageProcessor's) defaults: images resized to
# 4 * 364 pixels on their longest side, cut into tiles of 364, mean and std 0.5, Lanczos.
DEFAULT_TILE = 364
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, as preprocessor_config.json numbers it
# Checkpoint key prefixes of the vision parts (the Hub's and transformers 5's) -> the
# encoder's.
_HF_PREFIXES = {
    "model.vision_model.": "vision_model.",
    "model.connector.": "connector.",
}
_GGUF_NAMES = {
    "v.patch_embd.weight": "vision_model.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_model.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_model.post_layernorm.weight",
    "v.post_ln.bias": "vision_model.post_layernorm.bias",
    "mm.model.fc.weight": "connector.modality_projection.proj.weight",
}


@dataclass
class Idefics3Vision:
    """A loaded SmolVLM / Idefics3 image encoder and how images are prepared for it:
    resized to `longest_edge` pixels on their longest side (None: not resized), cut into
    square tiles of `tile` pixels plus the whole image at that size (`splitting`; else
    the whole image alone), resampled by Pillow filter `resample`, normalized by mean
    and std."""

    encoder: idefics3_vision.ImageEncoder
    longest_edge: int | None
    tile: int
    splitting: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = LANCZOS

    @property
    def tile_tokens(self) -> int:
        """The soft tokens of one tile (SmolVLMProcessor's image_seq_len)."""
        side = self.tile // self.encoder.args.vision.patch_size // self.encoder.args.scale_factor
        return side * side


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a SmolVLM or Idefics3 with its
    vision tower."""
    return config.get("model_type") in MODEL_TYPES and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a SmolVLM or Idefics3."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type idefics3 (read_gguf's checks)."""
    return projector_type(path) == VisionProjectorType.IDEFICS3


def from_hf_dir(path: Path, text_hidden: int) -> Idefics3Vision:
    """The image encoder of a SmolVLM or Idefics3 Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a SmolVLM or Idefics3 folder with a vision_config")
    args = idefics3_vision.EncoderArgs.from_config(config)
    weights = prefixed_weights(path, _HF_PREFIXES)
    settings = _processor_settings(path)
    return _build(args, weights, text_hidden, path, **settings)


def _processor_settings(path: Path) -> dict[str, Any]:
    """preprocessor_config.json's resizing, tiling and normalization, else
    SmolVLMImageProcessor's defaults."""
    file = path / "preprocessor_config.json"
    processor: dict[str, Any] = {}
    if file.is_file():
        try:
            processor = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: not readable JSON ({e})") from None
        if not isinstance(processor, dict):
            raise ModelFormatError(f"{file}: not a JSON object")

    def edge(key: str, default: int) -> int:
        size = processor.get(key, {"longest_edge": default})
        value = size.get("longest_edge") if isinstance(size, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFormatError(f"{file}: {key} is {size!r}, not a longest_edge in pixels")
        return value

    tile = edge("max_image_size", DEFAULT_TILE)
    resize = processor.get("do_resize", True)
    resample = processor.get("resample", LANCZOS)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter (0..5)")
    return dict(
        longest_edge=edge("size", 4 * DEFAULT_TILE) if resize else None,
        tile=tile,
        splitting=bool(processor.get("do_image_splitting", True)),
        mean=three_floats(processor.get("image_mean", DEFAULT_MEAN_STD), file, "image_mean"),
        std=three_floats(processor.get("image_std", DEFAULT_MEAN_STD), file, "image_std"),
        resample=resample,
    )


def from_mmproj(path: str | Path, text_hidden: int) -> Idefics3Vision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type idefics3). Its tiles
    are the tower's image_size; images are resized to clip.vision.preproc_image_size on
    their longest side (4 tiles where an older file does not say, the image processor's
    default) and always split, as SmolVLM's processors are set up."""
    gg, need = open_mmproj(path, VisionProjectorType.IDEFICS3)
    meta = gg.metadata
    vision = Keys.ClipVision

    args = idefics3_vision.EncoderArgs(
        siglip.VisionArgs(
            hidden_size=need(vision.EMBEDDING_LENGTH),
            intermediate_size=need(vision.FEED_FORWARD_LENGTH),
            num_hidden_layers=need(vision.BLOCK_COUNT),
            num_attention_heads=need(vision.Attention.HEAD_COUNT),
            image_size=need(vision.IMAGE_SIZE),
            patch_size=need(vision.PATCH_SIZE),
            layer_norm_eps=float(need(vision.Attention.LAYERNORM_EPS)),
        ),
        text_hidden_size=need(vision.PROJECTION_DIM),
        scale_factor=need(vision.Projector.SCALE_FACTOR, 2),
    )
    weights = mmproj_tensors(gg, _gguf_name, "SmolVLM's image encoder")
    tile = args.vision.image_size
    mean, std = (
        three_floats(meta.get(key, DEFAULT_MEAN_STD), gg.path, key)
        for key in (vision.IMAGE_MEAN, vision.IMAGE_STD)
    )
    return _build(
        args,
        weights,
        text_hidden,
        gg.path,
        longest_edge=need(vision.PREPROC_IMAGE_SIZE, 4 * tile),
        tile=tile,
        splitting=True,
        mean=mean,
        std=std,
    )


def _gguf_name(name: str) -> str | None:
    return mmproj_name(name, _GGUF_NAMES, SIGLIP_LAYER, "vision_model.encoder.layers.")


def _build(
    args: idefics3_vision.EncoderArgs,
    weights: dict[str, torch.Tensor],
    text_hidden: int,
    source: Path,
    **settings: Any,
) -> Idefics3Vision:
    """The encoder with `weights` (checked against its shapes), in f32."""
    unit = args.vision.patch_size * args.scale_factor
    if settings["tile"] % unit:
        raise ModelFormatError(
            f"{source}: tiles of {settings['tile']} pixels are not a multiple of {unit} "
            f"(patches of {args.vision.patch_size}, pixel-shuffled by {args.scale_factor})"
        )
    encoder = with_weights(
        idefics3_vision.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
    return Idefics3Vision(encoder, **settings)
