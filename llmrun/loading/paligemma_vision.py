"""PaliGemma 1's and 2's image encoder (llmrun.models.paligemma_vision) from its Hugging Face folder
(PaliGemmaForConditionalGeneration: vision_tower.* and multi_modal_projector.*, under
model. as transformers 5 saves them) with its image processor's settings
(SiglipImageProcessor). llama.cpp has no PaliGemma projector (tools/mtmd), so there is no
mmproj to read; its language model loads as text (llmrun.loading.vl_text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import image_processor, three_floats, with_weights
from llmrun.loading.vl_text import PALIGEMMA_TEXTS
from llmrun.models import siglip
from llmrun.models.paligemma_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "paligemma"
# PaliGemmaConfig's defaults where its config.json leaves them out.
_VISION_DEFAULTS = {
    "intermediate_size": 4096,
    "hidden_size": 1152,
    "patch_size": 14,
    "image_size": 224,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
}
PROJECTION_DIM = 2048
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, SiglipImageProcessor's default
SIGLIP_MEAN_STD = (0.5, 0.5, 0.5)
# Checkpoint key prefixes -> ImageEncoder's: the Hub's files (vision_tower.vision_model.),
# transformers 5's (no vision_model.).
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.vision_model.",
    "vision_tower.vision_model.": "vision_tower.vision_model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# SiglipVisionModel's attention-pooling head, which PaliGemma never runs.
_UNUSED = ".head."


@dataclass
class PaliGemmaVision:
    """A loaded PaliGemma image encoder and how images are prepared for it."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BICUBIC

    @property
    def image_size(self) -> int:
        return self.encoder.args.vision.image_size

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.args.tokens_per_image


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a PaliGemma with its vision tower."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE


def is_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no PaliGemma mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> PaliGemmaVision:
    """Refused: there is no PaliGemma mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no PaliGemma projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is PaliGemma 1's or 2's (vl_text's text types)."""
    return config.get("model_type") in PALIGEMMA_TEXTS.values()


def encoder_args(config: dict[str, Any]) -> EncoderArgs:
    """The encoder's settings from a PaliGemma config.json (PaliGemmaConfig's defaults where
    it leaves them out; its projection_dim is the top level's)."""
    vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    if vision.get("vision_use_head"):
        raise UnsupportedError("a PaliGemma vision tower with an attention-pooling head")
    projection = config.get("projection_dim", PROJECTION_DIM)
    return EncoderArgs(siglip.VisionArgs.from_config(vision), projection)


def from_hf_dir(path: Path, text_hidden: int) -> PaliGemmaVision:
    """PaliGemma's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != MODEL_TYPE:
        raise ModelFormatError(f"{path}: not a PaliGemma folder")
    args = encoder_args(config)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            new = _hf_name(name)
            if new is not None:
                weights[new] = tensor
    encoder = with_weights(ImageEncoder, args, weights, path, (args.projection_dim, text_hidden))
    return PaliGemmaVision(encoder, **_processor_settings(path, args))


def _hf_name(name: str) -> str | None:
    """The encoder's name of a checkpoint tensor; None for every other part's."""
    for old, new in _HF_PREFIXES.items():
        if name.startswith(old):
            return None if _UNUSED in name else new + name[len(old) :]
    return None


def _processor_settings(path: Path, args: EncoderArgs) -> dict[str, Any]:
    """SiglipImageProcessor's mean, std and filter (its defaults where the folder gives
    none), refused where they would not make the tower's square images or where its
    image_seq_length is not the tower's token count."""
    file, settings = image_processor(path)
    side = args.vision.image_size
    size = settings.get("size", {"height": side, "width": side})
    if size != {"height": side, "width": side}:
        raise UnsupportedError(f"{file}: images of size {size!r}; the tower takes {side}x{side}")
    tokens = settings.get("image_seq_length", args.tokens_per_image)
    if tokens != args.tokens_per_image:
        raise ModelFormatError(
            f"{file}: image_seq_length is {tokens!r}, but the vision tower makes "
            f"{args.tokens_per_image} tokens an image"
        )
    resample = settings.get("resample", BICUBIC)
    if resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter")
    return dict(
        mean=three_floats(settings.get("image_mean", SIGLIP_MEAN_STD), file, "image_mean"),
        std=three_floats(settings.get("image_std", SIGLIP_MEAN_STD), file, "image_std"),
        resample=resample,
    )
