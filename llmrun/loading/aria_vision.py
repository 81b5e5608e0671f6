"""Aria's image encoder (Idefics3's SigLIP tower and a cross-attention projector:
llmrun.models.aria_vision) from the Hugging Face folder of an AriaForConditionalGeneration
(rhymes-ai/Aria, as the Hub and transformers 5 save it), with its image processor's
settings (AriaImageProcessor: max_image_size 490 or 980, min_image_size, optional splitting
into crops of split_resolutions, bicubic, mean and std 0.5). Its language model runs as
DeepSeek V1's mixture of experts (llmrun.loading.vl_text). llama.cpp's converter writes no
Aria mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.aria_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "aria"
TEXT_MODEL_TYPE = "deepseek"  # as llmrun.loading.vl_text runs Aria's text
# AriaImageProcessor's defaults.
DEFAULT_MAX, DEFAULT_MIN = 980, 336
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
BICUBIC = 3
SPLIT_GRIDS = [(1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (2, 4), (2, 3), (2, 2)]
SPLIT_GRIDS += [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (5, 1), (6, 1), (7, 1), (8, 1)]
DEFAULT_SPLITS = [(rows * 490, columns * 490) for rows, columns in SPLIT_GRIDS]
# Split resolutions are canvases an image is drawn on: refuse sizes no Aria uses.
MAX_SPLIT_SIDE = 8192
_HF_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}


@dataclass
class AriaVision:
    """A loaded Aria image encoder and how images are prepared for it: each crop (the
    whole image, or with `splitting` the tiles of the split resolution that fits it best)
    resized so that its longer side is `max_image_size` and its shorter at least
    `min_image_size`, by Pillow filter `resample`, into a black square of max_image_size,
    normalized by mean and std."""

    encoder: ImageEncoder
    max_image_size: int
    min_image_size: int
    splitting: bool
    split_resolutions: list[tuple[int, int]]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BICUBIC

    @property
    def tokens_per_crop(self) -> int:
        return self.encoder.queries(self.max_image_size)


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an Aria with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is the DeepSeek V1 that Aria's text runs as."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Aria mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> AriaVision:
    """Refused: there is no Aria mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Aria projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int) -> AriaVision:
    """The image encoder of an Aria Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not an Aria folder with a vision_config")
    try:
        args = EncoderArgs.from_config(config)
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    weights = prefixed_weights(path, _HF_PREFIXES)
    encoder = with_weights(ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden))
    settings = _processor_settings(path)
    square = settings["max_image_size"]
    if square % args.vision.patch_size:
        raise ModelFormatError(
            f"{path}: max_image_size {square} is not whole {args.vision.patch_size}-pixel patches"
        )
    try:
        encoder.queries(square)
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    return AriaVision(encoder, **settings)


def _processor_settings(path: Path) -> dict[str, Any]:
    """The image processor's sizes, splitting and normalization, else
    AriaImageProcessor's defaults."""
    file, processor = image_processor(path)
    sizes = {}
    for key, default in (("max_image_size", DEFAULT_MAX), ("min_image_size", DEFAULT_MIN)):
        sizes[key] = processor.get(key, default)
        if not positive_int(sizes[key]):
            raise ModelFormatError(f"{file}: {key} is {sizes[key]!r}, not a size in pixels")
    resample = processor.get("resample", BICUBIC)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter (0..5)")
    splits = processor.get("split_resolutions") or DEFAULT_SPLITS
    ok = isinstance(splits, list) and all(
        isinstance(s, list | tuple) and len(s) == 2 and all(positive_int(v) for v in s)
        for s in splits
    )
    if not ok or max(max(s) for s in splits) > MAX_SPLIT_SIDE:
        raise ModelFormatError(f"{file}: split_resolutions is {splits!r}")
    return dict(
        **sizes,
        splitting=bool(processor.get("split_image", False)),
        split_resolutions=[(s[0], s[1]) for s in splits],
        mean=three_floats(processor.get("image_mean", DEFAULT_MEAN_STD), file, "image_mean"),
        std=three_floats(processor.get("image_std", DEFAULT_MEAN_STD), file, "image_std"),
        resample=resample,
    )
