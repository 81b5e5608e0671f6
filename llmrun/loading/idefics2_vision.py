"""Idefics2's image encoder (SigLIP tower, SwiGLU projection, perceiver resampler:
llmrun.models.idefics2_vision) from the Hugging Face folder of an
Idefics2ForConditionalGeneration (HuggingFaceM4/idefics2-8b, as the Hub and transformers 5
save it), with its image processor's settings (Idefics2ImageProcessor: the shortest and
longest edge, optional splitting into four crops, bilinear, mean and std 0.5). Its
language model, a Mistral, loads as for text. llama.cpp's converter writes no Idefics2
mmproj.
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
from llmrun.models.idefics2_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "idefics2"
TEXT_MODEL_TYPES = ("mistral", "llama")
# Idefics2ImageProcessor's defaults (IMAGENET_STANDARD_MEAN and _STD are 0.5).
DEFAULT_SIZE = {"shortest_edge": 378, "longest_edge": 980}
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as preprocessor_config.json numbers it
_HF_PREFIXES = {"model.vision_model.": "vision_model.", "model.connector.": "connector."}


@dataclass
class Idefics2Vision:
    """A loaded Idefics2 image encoder and how images are prepared for it: split into four
    crops plus the whole image (`splitting`), each resized to at most `longest_edge` and at
    least `shortest_edge` pixels a side (None: not resized) by Pillow filter `resample`,
    normalized by mean and std."""

    encoder: ImageEncoder
    shortest_edge: int | None
    longest_edge: int | None
    splitting: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int = BILINEAR

    @property
    def tokens_per_frame(self) -> int:
        """The soft tokens of the whole image or of one crop (the perceiver's latents)."""
        return self.encoder.args.perceiver.resampler_n_latents

    @property
    def frames(self) -> int:
        """How many pictures of an image the tower sees: the four crops and the whole."""
        return 5 if self.splitting else 1


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an Idefics2 with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Mistral's (llmrun runs it as a Llama)."""
    return config.get("model_type") in TEXT_MODEL_TYPES


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Idefics2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Idefics2Vision:
    """Refused: there is no Idefics2 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Idefics2 projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Idefics2Vision:
    """The image encoder of an Idefics2 Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not an Idefics2 folder with a vision_config")
    args = EncoderArgs.from_config(config)
    weights = prefixed_weights(path, _HF_PREFIXES)
    encoder = with_weights(ImageEncoder, args, weights, path, (args.text_hidden_size, text_hidden))
    return Idefics2Vision(encoder, **_processor_settings(path))


def _processor_settings(path: Path) -> dict[str, Any]:
    """The image processor's resizing, splitting and normalization, else
    Idefics2ImageProcessor's defaults."""
    file, processor = image_processor(path)
    size = processor.get("size", DEFAULT_SIZE)
    edges = isinstance(size, dict) and set(size) == {"shortest_edge", "longest_edge"}
    if not edges or not all(positive_int(v) for v in size.values()):
        raise ModelFormatError(f"{file}: size is {size!r}, not a shortest and longest edge")
    resample = processor.get("resample", BILINEAR)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in range(6):
        raise ModelFormatError(f"{file}: resample is {resample!r}, not a Pillow filter (0..5)")
    resize = processor.get("do_resize", True)
    return dict(
        shortest_edge=size["shortest_edge"] if resize else None,
        longest_edge=size["longest_edge"] if resize else None,
        splitting=bool(processor.get("do_image_splitting", False)),
        mean=three_floats(processor.get("image_mean", DEFAULT_MEAN_STD), file, "image_mean"),
        std=three_floats(processor.get("image_std", DEFAULT_MEAN_STD), file, "image_std"),
        resample=resample,
    )
