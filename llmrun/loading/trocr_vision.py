"""TrOCR's image encoder (a ViT or DeiT: llmrun.models.vit) from the Hugging Face folder of its
VisionEncoderDecoderModel (encoder.*; the pooler its checkpoints may hold is never run), with
its image processor's settings: ViTImageProcessor's (resized to a square, bilinear by default,
no crop) or DeiTImageProcessor's (bicubic, then a centre crop), rescaled by 1/255 and
normalized (the Hub's files: 384 pixels, mean and std 0.5). llama.cpp has no TrOCR
converter: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io, trocr
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.vit import VitArgs, VitModel

# The processors' defaults: ViTImageProcessor's and DeiTImageProcessor's (ImageNet's mean
# and std, IMAGENET_STANDARD for ViT's: 0.5).
_VIT = dict(size=224, resample=2, crop=False, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
_DEIT = dict(
    size=256,
    resample=3,
    crop=True,
    crop_size=224,
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
)
_UNUSED = "pooler."


@dataclass
class TrOcrVision:
    """A loaded TrOCR image encoder and how images are prepared for it: resized to `size`
    (height, width) with Pillow filter `resample`, centre-cropped to `crop` (height, width)
    where the processor crops, normalized."""

    encoder: VitModel
    size: tuple[int, int]
    crop: tuple[int, int] | None
    resample: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a vision-encoder-decoder's (TrOCR's or refused by
    name when it loads)."""
    return safetensors_io.read_config(path).get("model_type") == trocr.MODEL_TYPE


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is TrOCR's decoder."""
    return config.get("model_type") == trocr.DECODER_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no TrOCR mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> TrOcrVision:
    """Refused: there is no TrOCR mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no TrOCR image encoder; give its folder")


def _side(value: Any, source: Path, key: str) -> tuple[int, int]:
    """A processor size: an int (a square) or {"height": h, "width": w}."""
    if positive_int(value):
        return value, value
    if isinstance(value, dict) and set(value) == {"height", "width"}:
        if all(positive_int(v) for v in value.values()):
            return value["height"], value["width"]
    raise UnsupportedError(f"{source}: {key} {value!r} (llmrun takes a height and width)")


def from_hf_dir(path: Path, text_hidden: int | None) -> TrOcrVision:
    """TrOCR's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a vision-encoder-decoder folder")
    encoder, _ = trocr.check_pair(config, path)
    args = VitArgs.from_config(encoder)
    source, settings = image_processor(path)
    kind = str(settings.get("image_processor_type") or settings.get("feature_extractor_type"))
    defaults = _DEIT if kind.startswith("DeiT") else _VIT
    size = _side(settings.get("size", defaults["size"]), source, "size")
    crop = None
    if settings.get("do_center_crop", defaults["crop"]):
        crop = _side(settings.get("crop_size", defaults.get("crop_size")), source, "crop_size")
    shape = crop or size
    if shape != (args.image_size, args.image_size):
        raise ModelFormatError(
            f"{source}: images of {shape[0]}x{shape[1]} pixels, but the encoder takes "
            f"{args.image_size}x{args.image_size}"
        )
    factor = settings.get("rescale_factor", 1 / 255)
    if not (
        settings.get("do_resize", True)
        and settings.get("do_rescale", True)
        and settings.get("do_normalize", True)
        and isinstance(factor, float)
        and abs(factor * 255 - 1) < 1e-9
    ):
        raise UnsupportedError(
            f"{source}: llmrun resizes, rescales by 1/255 and normalizes TrOCR's images"
        )
    resample = settings.get("resample", defaults["resample"])
    if resample not in range(6) or isinstance(resample, bool):
        raise ModelFormatError(f"{source}: resample is {resample!r}, not a Pillow filter")
    mean = three_floats(settings.get("image_mean", defaults["mean"]), source, "image_mean")
    std = three_floats(settings.get("image_std", defaults["std"]), source, "image_std")
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, {"encoder.": ""}).items()
        if not name.startswith(_UNUSED)
    }
    width = args.hidden_size
    model = with_weights(VitModel, args, weights, path, (width, text_hidden or width))
    return TrOcrVision(model, size, crop, resample, mean, std)
