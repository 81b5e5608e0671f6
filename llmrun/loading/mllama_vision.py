"""Llama 3.2 Vision's image encoder (llmrun.models.mllama_vision) from the Hugging Face folder
of an MllamaForConditionalGeneration (model.vision_model.* and model.multi_modal_projector.*
as transformers 5 saves it; vision_model.* and multi_modal_projector.* as Meta's files on the
Hub hold them), with MllamaImageProcessor's settings (preprocessor_config.json). llama.cpp
has no mllama projector, so there is no mmproj to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    three_floats,
    with_weights,
)
from llmrun.models.mllama_vision import EncoderArgs, ImageEncoder, VisionArgs

MODEL_TYPE = "mllama"
TEXT_TYPE = "mllama_text"  # llmrun's model_type of its language model (loading/vl_text.py)
# MllamaImageProcessor's defaults: OpenAI CLIP's mean and std (Llama 3.2 Vision's files say
# so too), bilinear resizing.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
_HF_PREFIXES = {
    "model.vision_model.": "vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "vision_model.": "vision_model.",
    "multi_modal_projector.": "multi_modal_projector.",
}


@dataclass
class MllamaVision:
    """A loaded Llama 3.2 Vision image encoder and how images are cut into its tiles."""

    encoder: ImageEncoder
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_token: int  # the id of <|image|> (image_token_index)

    @property
    def tile(self) -> int:
        return self.encoder.args.vision.image_size

    @property
    def max_tiles(self) -> int:
        return self.encoder.args.vision.max_num_tiles


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an mllama with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def is_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no mllama mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> MllamaVision:
    """Refused: there is no mllama mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Llama 3.2 Vision projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Llama 3.2 Vision's (with cross-attention layers)."""
    return config.get("model_type") == TEXT_TYPE and bool(config.get("cross_attention_layers"))


def from_hf_dir(path: Path, text_hidden: int) -> MllamaVision:
    """The image encoder of an mllama folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise ModelFormatError(f"{path}: not an mllama folder with a vision_config")
    try:
        vision = VisionArgs.from_config(config["vision_config"])
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path / 'config.json'}: {e}") from None
    image_token = config.get("image_token_index", 128256)
    vocab = (config.get("text_config") or {}).get("vocab_size", 128256)
    if image_token != vocab:
        # <|image|> takes the first of the embedding's rows past the vocabulary.
        raise ModelFormatError(
            f"{path / 'config.json'}: image_token_index is {image_token!r}, not the "
            f"vocabulary's size {vocab}"
        )
    args = EncoderArgs(vision, text_hidden)
    weights = prefixed_weights(path, _HF_PREFIXES)
    encoder = with_weights(ImageEncoder, args, weights, path, (text_hidden, text_hidden))
    return MllamaVision(encoder, *_processor_settings(path, vision), image_token)


def _processor_settings(path: Path, vision: VisionArgs) -> tuple[tuple[float, ...], ...]:
    """MllamaImageProcessor's mean and std (its defaults where the folder gives none), its
    other settings refused where they are not the tower's tiles."""
    file, settings = image_processor(path)
    side = vision.image_size
    size = settings.get("size", {"height": side, "width": side})
    tiles = settings.get("max_image_tiles", vision.max_num_tiles)
    if size != {"height": side, "width": side} or not positive_int(tiles):
        raise UnsupportedError(
            f"{file}: tiles of size {size!r}; the vision tower takes {side}x{side}"
        )
    if tiles != vision.max_num_tiles:
        raise ModelFormatError(
            f"{file}: max_image_tiles is {tiles}, but the vision tower takes "
            f"{vision.max_num_tiles} tiles"
        )
    for key, value in (("do_resize", True), ("do_pad", True), ("do_normalize", True)):
        if settings.get(key, value) is not value:
            raise UnsupportedError(
                f"{file}: {key} {settings[key]!r}; llmrun prepares tiles as mllama's processor does by default"
            )
    if settings.get("resample", BILINEAR) != BILINEAR:
        raise UnsupportedError(
            f"{file}: resample {settings['resample']!r}; llmrun resizes bilinearly, as "
            "MllamaImageProcessor does"
        )
    if (
        settings.get("rescale_factor", 1 / 255) != 1 / 255
        or settings.get("do_rescale", True) is not True
    ):
        raise UnsupportedError(f"{file}: pixels not rescaled by 1/255")
    mean = three_floats(settings.get("image_mean", CLIP_MEAN), file, "image_mean")
    std = three_floats(settings.get("image_std", CLIP_STD), file, "image_std")
    return mean, std
