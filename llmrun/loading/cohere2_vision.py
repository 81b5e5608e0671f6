"""Command A Vision's image encoder (SigLIP tower, pixel shuffle, SwiGLU projector) from its
Hugging Face folder (Cohere2VisionForConditionalGeneration, whose preprocessor_config.json
says how images are tiled). llama.cpp has no converter or mmproj for it, so the folder is
the one format; the language model (Cohere2) loads as for text (llmrun.loading.vl_text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.qwen2_vl_vision import CLIP_MEAN, CLIP_STD
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models import cohere2_vision

MODEL_TYPE = "cohere2_vision"
BILINEAR, BICUBIC = 2, 3  # Pillow's filter numbers, as preprocessor_config.json gives them
# Checkpoint key prefixes of the vision parts -> the encoder's: the Hub's (transformers
# 4's SiglipVisionModel, under vision_model) and transformers 5's (without it).
_HF_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.vision_model.",
    "vision_tower.vision_model.": "vision_tower.vision_model.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
# tokenizer_config.json's extra_special_tokens that Cohere2VisionProcessor reads, and the
# names they have where it gives none (Aya Vision's and Command A Vision's).
_TOKEN_KEYS = ("boi_token", "image_token", "img_line_break_token", "eoi_token")
DEFAULT_TOKENS = ("<|START_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "<|END_OF_IMG|>")
# SigLIP's pooling head, which get_image_features never runs.
_UNUSED = "vision_tower.vision_model.head."


@dataclass
class Cohere2Vision:
    """A loaded Command A Vision image encoder and how images are tiled for it
    (Cohere2VisionImageProcessor): square tiles of `tile` pixels, a grid of at most
    `max_tiles` of them plus a thumbnail where the grid has several (`crop_to_patches`;
    else the whole image alone), resampled by Pillow filter `resample`, normalized by
    mean and std."""

    encoder: cohere2_vision.ImageEncoder
    tile: int
    crop_to_patches: bool
    max_tiles: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BICUBIC
    # Cohere2VisionProcessor's image tokens, as the tokenizer names them: the start, each
    # soft token's, a tile's line break, the end.
    tokens: tuple[str, str, str, str] = DEFAULT_TOKENS

    @property
    def tile_tokens(self) -> int:
        return self.encoder.args.tile_tokens


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a config.json is Command A Vision's with its vision tower."""
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def folder_has_vision(path: Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def text_takes_images(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "cohere2"


def is_mmproj(path: str | Path) -> bool:
    """No mmproj GGUF holds this encoder: llama.cpp does not convert it."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Cohere2Vision:
    """Refused: is_mmproj takes no file."""
    raise UnsupportedError(f"{path}: llmrun takes Command A Vision's images from its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Cohere2Vision:
    """The image encoder of a Command A Vision Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a Command A Vision folder with a vision_config")
    args = cohere2_vision.EncoderArgs.from_config(config)
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _HF_PREFIXES).items()
        if not name.startswith(_UNUSED)
    }
    settings = _processor_settings(path, args)
    encoder = with_weights(
        cohere2_vision.ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden)
    )
    return Cohere2Vision(encoder, **settings, tokens=_image_tokens(path))


def _image_tokens(path: Path) -> tuple[str, str, str, str]:
    """The image tokens tokenizer_config.json's extra_special_tokens name, else
    DEFAULT_TOKENS."""
    file = path / "tokenizer_config.json"
    config = safetensors_io.read_json(file) if file.is_file() else {}
    named = config.get("extra_special_tokens")
    named = named if isinstance(named, dict) else {}
    tokens = tuple(named.get(k, d) for k, d in zip(_TOKEN_KEYS, DEFAULT_TOKENS, strict=True))
    if not all(isinstance(t, str) and t for t in tokens):
        raise ModelFormatError(f"{file}: extra_special_tokens's image tokens are not all names")
    return tokens


def _processor_settings(path: Path, args: cohere2_vision.EncoderArgs) -> dict[str, Any]:
    """The image processor's tiling and normalization, else Cohere2VisionImageProcessor's
    defaults; tiles must be the tower's image_size (its positions are not interpolated)."""
    source, settings = image_processor(path)
    size = settings.get("size", {"height": args.vision.image_size, "width": args.vision.image_size})
    tile = size.get("height") if isinstance(size, dict) else None
    if not positive_int(tile) or size.get("width") != tile or tile != args.vision.image_size:
        raise ModelFormatError(
            f"{source}: size is {size!r}, not square tiles of the vision tower's "
            f"{args.vision.image_size} pixels"
        )
    max_tiles = settings.get("max_patches", 12)
    if not positive_int(max_tiles):
        raise ModelFormatError(f"{source}: max_patches is {max_tiles!r}, not a positive integer")
    resample = settings.get("resample", BICUBIC)
    if resample not in (BILINEAR, BICUBIC) or isinstance(resample, bool):
        raise ModelFormatError(
            f"{source}: resample is {resample!r}; llmrun resizes bilinearly (2) or bicubically (3)"
        )
    # The processor's patch_size is the soft tokens of a tile's side.
    side = settings.get("patch_size", 16)
    if not positive_int(side) or side * side != args.tile_tokens:
        raise ModelFormatError(
            f"{source}: patch_size is {side!r}, but the encoder makes {args.tile_tokens} "
            "tokens a tile (patch_size squared)"
        )
    return dict(
        tile=tile,
        crop_to_patches=bool(settings.get("crop_to_patches", True)),
        max_tiles=max_tiles,
        mean=three_floats(settings.get("image_mean", CLIP_MEAN), source, "image_mean"),
        std=three_floats(settings.get("image_std", CLIP_STD), source, "image_std"),
        resample=resample,
    )
