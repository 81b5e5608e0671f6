"""Kosmos-2's image encoder (llmrun.models.kosmos2_vision) from the Hugging Face folder of a
Kosmos2ForConditionalGeneration (vision_model.*, image_to_text_projection.*), with
CLIPImageProcessor's settings (read as LLaVA's are; use_square_size, which
microsoft/kosmos-2-patch14-224's file sets, resizes to a 224-pixel square as
CLIPImageProcessor does for it) and the prompt's image tokens (Kosmos2Processor's: <image>
and </image> around latent_query_num placeholders, the ids after <unk>'s). Folders only:
llama.cpp has no converter for Kosmos-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.llava_vision import _processor_settings
from llmrun.loading.vision import image_processor, positive_int, prefixed_weights, with_weights
from llmrun.models.kosmos2_vision import EncoderArgs, ImageEncoder
from llmrun.models.llava_vision import VisionArgs

MODEL_TYPE = "kosmos-2"
TEXT_MODEL_TYPE = "kosmos2_text"
_PREFIXES = {
    "vision_model.": "vision_model.",
    "image_to_text_projection.": "image_to_text_projection.",
}
# CLIPImageProcessor's square for use_square_size: its default shortest_edge, whatever
# the file's size says.
_SQUARE = 224
# Kosmos2VisionConfig's defaults where they differ from CLIP's.
_VISION_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "patch_size": 14}  # fmt: skip


@dataclass
class Kosmos2Vision:
    """A loaded Kosmos-2 image encoder and CLIPImageProcessor's settings for it: the image
    resized to `size` (its shorter side, or (height, width)) with Pillow filter
    `resample`, centre-cropped to `crop` where the processor crops, normalized."""

    encoder: ImageEncoder
    size: int | tuple[int, int]
    crop: tuple[int, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int

    @property
    def queries(self) -> int:
        return self.encoder.args.queries


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Kosmos-2 (Kosmos2ForConditionalGeneration)."""
    return safetensors_io.read_config(path).get("model_type") == MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Kosmos-2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Kosmos2Vision:
    """Refused: there is no Kosmos-2 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Kosmos-2 image encoder; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Kosmos-2's."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def from_hf_dir(path: Path, text_hidden: int) -> Kosmos2Vision:
    """Kosmos-2's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != MODEL_TYPE:
        raise ModelFormatError(f"{path}: not a Kosmos-2 folder")
    vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    text = config.get("text_config") or {}
    heads, queries = text.get("attention_heads", 32), config.get("latent_query_num", 64)
    if not positive_int(heads) or not positive_int(queries) or text_hidden % heads:
        raise ModelFormatError(
            f"{path}: Kosmos-2's latent_query_num {queries!r} or text attention_heads {heads!r}"
        )
    args = EncoderArgs(VisionArgs.from_config(vision), text_hidden, heads, queries)
    settings = _processor_settings(path, args.vision.image_size, False)
    if settings.pop("pad"):
        raise UnsupportedError(f"{path}: Kosmos-2's images are not padded to a square (do_pad)")
    if image_processor(path)[1].get("use_square_size"):
        settings["size"] = (_SQUARE, _SQUARE)
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(ImageEncoder, args, weights, path, (text_hidden, text_hidden))
    return Kosmos2Vision(encoder, **settings)
