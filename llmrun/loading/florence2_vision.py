"""Florence-2's image encoder (llmrun.models.florence2_vision) from the Hugging Face folder of a
Florence2ForConditionalGeneration (transformers 5's format: microsoft/Florence-2-* as
florence-community converted them), with its image processor's settings (CLIPImageProcessor:
resized to its height x width, no crop, rescaled, normalized; Florence-2's files say 768 x
768, bicubic, ImageNet's mean and std). Its language model is BART's (llmrun.loading.vl_text
reads its text_config), whose encoder takes the image tokens first. llama.cpp has no
Florence-2 converter: no mmproj.
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
from llmrun.loading.vl_text import florence2_text_fields
from llmrun.models.florence2_vision import ImageEncoder, VisionArgs

MODEL_TYPE = "florence2"
TEXT_MODEL_TYPE = "bart"
# CLIPImageProcessor's defaults (OPENAI_CLIP_MEAN and _STD, bicubic).
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3
_PREFIXES = {
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}
# Florence2VisionPositionalEmbeddingCosine1D's sinusoid table, which the encoder computes.
_COMPUTED = "multi_modal_projector.visual_temporal_embed."


@dataclass
class Florence2Vision:
    """A loaded Florence-2 image encoder and how images are prepared for it: resized to
    `size` (height, width) with Pillow filter `resample`, normalized; each takes `tokens`
    prompt tokens of id `image_token_id`."""

    encoder: ImageEncoder
    size: tuple[int, int]
    resample: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    tokens: int
    image_token_id: int


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Florence-2's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is Florence-2's BART (vl_text keeps its
    image_token_id)."""
    return config.get("model_type") == TEXT_MODEL_TYPE and "image_token_id" in config


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Florence-2 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Florence2Vision:
    """Refused: there is no Florence-2 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Florence-2 projector; give its folder")


def grid(args: VisionArgs, height: int, width: int) -> tuple[int, int]:
    """The (rows, columns) of the last stage's grid for pixels of height x width: each
    stage's convolution's output size."""
    for kernel, stride, padding in zip(
        args.patch_size, args.patch_stride, args.patch_padding, strict=True
    ):
        height = (height + 2 * padding - kernel) // stride + 1
        width = (width + 2 * padding - kernel) // stride + 1
    return height, width


def _pixels(settings: dict[str, Any], source: Path) -> tuple[tuple[int, int], int]:
    """The processor's (height, width) and resample filter; what it would do otherwise than
    resize to a fixed size, rescale by 1/255 and normalize is refused."""
    size = settings.get("size")
    if not (
        isinstance(size, dict)
        and set(size) == {"height", "width"}
        and all(positive_int(v) for v in size.values())
    ):
        raise UnsupportedError(
            f"{source}: size {size!r} (llmrun resizes Florence-2's images to a height and width)"
        )
    shape = (size["height"], size["width"])
    crop = settings.get("crop_size", {"height": 224, "width": 224})  # CLIPImageProcessor's
    if settings.get("do_center_crop", True) and crop != size:
        raise UnsupportedError(f"{source}: a centre crop to {crop!r} after resizing to {size!r}")
    if not settings.get("do_resize", True) or not settings.get("do_normalize", True):
        raise UnsupportedError(f"{source}: do_resize and do_normalize must be true")
    factor = settings.get("rescale_factor", 1 / 255)
    if (
        not settings.get("do_rescale", True)
        or not isinstance(factor, float)
        or (abs(factor * 255 - 1) > 1e-9)
    ):
        raise UnsupportedError(f"{source}: rescaling other than by 1/255")
    resample = settings.get("resample", _BICUBIC)
    if resample not in range(6) or isinstance(resample, bool):
        raise ModelFormatError(f"{source}: resample is {resample!r}, not a Pillow filter")
    return shape, resample


def from_hf_dir(path: Path, text_hidden: int | None) -> Florence2Vision:
    """Florence-2's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a Florence-2 folder with a vision_config")
    text = config.get("text_config")
    if not isinstance(text, dict) or not positive_int(text.get("d_model")):
        raise ModelFormatError(f"{path}: a Florence-2 config without its text_config's d_model")
    args = VisionArgs.from_config(config["vision_config"])
    source, settings = image_processor(path)
    shape, resample = _pixels(settings, source)
    rows, columns = grid(args, *shape)
    if max(rows, columns) > args.max_position_embeddings:
        raise ModelFormatError(
            f"{source}: a {rows}x{columns} grid of image features is more than the "
            f"{args.max_position_embeddings} rows and columns the model has positions for"
        )
    tokens = 1 + rows * columns
    expected = settings.get("image_seq_length", tokens)
    if expected != tokens:
        raise ModelFormatError(
            f"{source}: image_seq_length {expected!r}, but a {shape[0]}x{shape[1]} image "
            f"makes {tokens} image tokens"
        )
    mean = three_floats(settings.get("image_mean", _MEAN), source, "image_mean")
    std = three_floats(settings.get("image_std", _STD), source, "image_std")
    weights = {
        name: tensor
        for name, tensor in prefixed_weights(path, _PREFIXES).items()
        if not name.startswith(_COMPUTED)
    }
    width = text["d_model"]
    encoder = with_weights(
        ImageEncoder, args, weights, path, (args.projection_dim, text_hidden or width)
    )
    token = florence2_text_fields(config)["image_token_id"]
    return Florence2Vision(encoder, shape, resample, mean, std, tokens, token)
