"""Pix2Struct's image encoder (llmrun.models.pix2struct_vision) from the Hugging Face folder
of a Pix2StructForConditionalGeneration (encoder.*), with Pix2StructImageProcessor's
settings: max_patches and the patch size. Its VQA models (is_vqa: DePlot, MatCha, the
DocVQA, ChartQA, AI2D ones) render the question into the image above it in Arial, a font
llmrun does not ship: they are refused; the captioning ones (TextCaps, Screen2Words) run.
Folders only: llama.cpp has no converter for Pix2Struct.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import pix2struct, safetensors_io
from llmrun.loading.vision import image_processor, positive_int, prefixed_weights, with_weights
from llmrun.models.pix2struct_vision import VisionArgs, VisionModel

# Pix2StructImageProcessor's defaults.
_MAX_PATCHES, _PATCH = 2048, 16


@dataclass
class Pix2StructVision:
    """A loaded Pix2Struct image encoder and how images are cut for it: at most
    `max_patches` patches of `patch` (height, width) pixels, each image standardized by
    its own mean and deviation where `normalize`."""

    encoder: VisionModel
    max_patches: int
    patch: tuple[int, int]
    normalize: bool


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Pix2Struct (Pix2StructForConditionalGeneration)."""
    return safetensors_io.read_config(path).get("model_type") == pix2struct.MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Pix2Struct mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Pix2StructVision:
    """Refused: there is no Pix2Struct mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Pix2Struct image encoder; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Pix2Struct's decoder."""
    return config.get("model_type") == pix2struct.MODEL_TYPE


def from_hf_dir(path: Path, text_hidden: int | None) -> Pix2StructVision:
    """Pix2Struct's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != pix2struct.MODEL_TYPE:
        raise ModelFormatError(f"{path}: not a Pix2Struct folder")
    source, settings = image_processor(path)
    if config.get("is_vqa") or settings.get("is_vqa"):
        raise UnsupportedError(
            f"{path}: a Pix2Struct VQA model (is_vqa), whose processor renders the question "
            "into the image in Arial; llmrun runs the captioning ones (no prompt)"
        )
    args = VisionArgs.from_config(config.get("vision_config") or {})
    max_patches = settings.get("max_patches", _MAX_PATCHES)
    patch = settings.get("patch_size", {"height": _PATCH, "width": _PATCH})
    sides = (patch.get("height"), patch.get("width")) if isinstance(patch, dict) else ()
    if not positive_int(max_patches) or len(sides) != 2 or not all(map(positive_int, sides)):
        raise ModelFormatError(
            f"{source}: max_patches {max_patches!r} or patch_size {patch!r} is not a size"
        )
    if 3 * sides[0] * sides[1] != args.patch_embed_hidden_size:
        raise ModelFormatError(
            f"{source}: patches of {sides[0]}x{sides[1]} pixels, but the encoder takes "
            f"{args.patch_embed_hidden_size} values a patch"
        )
    if max_patches >= args.seq_len:
        raise ModelFormatError(
            f"{source}: max_patches {max_patches} is past the encoder's {args.seq_len} row "
            "and column ids"
        )
    weights = prefixed_weights(path, {"encoder.": ""})
    # The decoder's width: its config names it d_model (llmrun.loading.pix2struct).
    width = text_hidden or (config.get("text_config") or {}).get("hidden_size", 768)
    encoder = with_weights(VisionModel, args, weights, path, (args.hidden_size, width))
    return Pix2StructVision(encoder, max_patches, sides, bool(settings.get("do_normalize", True)))
