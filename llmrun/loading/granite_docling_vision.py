"""Granite Docling's image encoder (Idefics3's SigLIP tower, a connector with DeepStack
mergers) from its Hugging Face folder (GraniteDoclingForConditionalGeneration, model_type
granite_docling), and the image processor's settings (GraniteDoclingImageProcessor's: the
page cut into square tiles on a GOT-OCR2 grid). llama.cpp's converter has no
granite_docling, so there is no mmproj GGUF; the language model (Granite) loads as for
text (llmrun.loading.vl_text).
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
from llmrun.models import granite_docling_vision

MODEL_TYPE = "granite_docling"
TEXT_TYPE = "granite_docling_text"
# GraniteDoclingImageProcessor's defaults (GotOcr2ImageProcessor's mean, std and bicubic).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor_config.json numbers it
MIN_TILES, MAX_TILES = 1, 32
_HF_PREFIXES = {"model.vision_model.": "vision_model."}


@dataclass
class GraniteDoclingVision:
    """A loaded Granite Docling image encoder and how pages are prepared for it: cut into
    tiles of `tile` pixels on a grid of min_tiles..max_tiles (`crop`; else one tile), or
    of up to dense_max_tiles for a page the spread rule selects (dense_*: 0 skips a
    test), resampled by Pillow filter `resample`, normalized by mean and std; `fine`: the
    fine connector path (four times the tokens a tile)."""

    encoder: granite_docling_vision.ImageEncoder
    tile: int
    crop: bool
    min_tiles: int
    max_tiles: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BICUBIC
    fine: bool = False
    dense_max_tiles: int = 0
    dense_max_scale: float = 0.0
    dense_min_aspect: float = 0.0
    dense_max_aspect: float = 0.0

    @property
    def tile_tokens(self) -> int:
        """The <image> tokens of one tile (the processor's image_seq_len, times 4 fine)."""
        return self.encoder.args.tile_tokens(self.fine)


def has_vision(config: dict[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a Granite Docling (500M's architecture)."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def no_mmproj(path: str | Path) -> bool:
    """No mmproj GGUF is Granite Docling's: llama.cpp's converter has none."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> GraniteDoclingVision:
    """Refused: there is no Granite Docling mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Granite Docling projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == TEXT_TYPE


def from_hf_dir(path: Path, text_hidden: int) -> GraniteDoclingVision:
    """The image encoder of a Granite Docling Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Granite Docling folder with a vision_config")
    try:
        args = granite_docling_vision.EncoderArgs.from_config(config)
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    settings = _processor_settings(path, args)
    weights = prefixed_weights(path, _HF_PREFIXES)
    encoder = with_weights(
        granite_docling_vision.ImageEncoder,
        args,
        weights,
        path,
        (args.text_hidden_size, text_hidden),
    )
    return GraniteDoclingVision(encoder, **settings)


def _processor_settings(path: Path, args: granite_docling_vision.EncoderArgs) -> dict[str, Any]:
    """preprocessor_config.json's (or processor_config.json's image_processor) tiling,
    resampling and normalization, else GraniteDoclingImageProcessor's defaults."""
    file, processor = image_processor(path)
    image_size = args.vision.image_size
    size = processor.get("size", {"height": image_size, "width": image_size})
    if (
        not isinstance(size, dict)
        or size.get("height") != image_size
        or size.get("width") != image_size
    ):
        raise ModelFormatError(
            f"{file}: size is {size!r}, not the tower's square tiles of {image_size} pixels"
        )
    tiles = [
        processor.get(k, d) for k, d in (("min_patches", MIN_TILES), ("max_patches", MAX_TILES))
    ]
    if not all(positive_int(t) for t in tiles) or tiles[0] > tiles[1]:
        raise ModelFormatError(f"{file}: min_patches and max_patches are {tiles}")
    resample = processor.get("resample", BICUBIC)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter (0..5)")
    if not processor.get("do_rescale", True) or processor.get("rescale_factor", 1 / 255) != 1 / 255:
        raise UnsupportedError(f"{file}: pixels not rescaled by 1/255, as llmrun rescales them")
    fine = bool(processor.get("fine_route", False))
    if fine and not args.use_fine_route:
        raise ModelFormatError(f"{file}: fine_route is set, but the model has no fine path")
    dense = processor.get("dense_max_patches", 0)
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise ModelFormatError(f"{file}: dense_max_patches is {dense!r}, not a tile count")
    bounds = {
        k: processor.get(k, 0.0)
        for k in ("dense_max_scale", "dense_min_aspect", "dense_max_aspect")
    }
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bounds.values()):
        raise ModelFormatError(f"{file}: dense bounds {bounds} are not numbers")
    return dict(
        tile=image_size,
        crop=bool(processor.get("crop_to_patches", True)),
        min_tiles=tiles[0],
        max_tiles=tiles[1],
        mean=three_floats(processor.get("image_mean", CLIP_MEAN), file, "image_mean"),
        std=three_floats(processor.get("image_std", CLIP_STD), file, "image_std"),
        resample=resample,
        fine=fine,
        dense_max_tiles=dense,
        dense_max_scale=float(bounds["dense_max_scale"]),
        dense_min_aspect=float(bounds["dense_min_aspect"]),
        dense_max_aspect=float(bounds["dense_max_aspect"]),
    )
