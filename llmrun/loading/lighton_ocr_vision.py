"""LightOnOCR's image encoder (Pixtral's tower, Mistral 3's projector without biases) from
either format: its Hugging Face folder (LightOnOcrForConditionalGeneration, model_type
lighton_ocr; LightOnOCR-1B's first files say mistral3 with architecture
LightOnOCRForConditionalGeneration), or the mmproj GGUF that llama.cpp's converter writes
beside the text model's GGUF (conversion/lighton_ocr.py: projector type lightonocr, laid
out as pixtral's, without an [IMG_BREAK] row). Both give the encoder HF's weights.

Images are resized as the folder's image processor (PixtralImageProcessor) says: sides in
multiples of its patch_size, which transformers 5's LightOnOcrProcessor passes as it is
(the encoder then leaves out a last row or column of patches short of a merged token, as
its unfold does); llama.cpp resizes to multiples of a merged token's side, as an mmproj's
images are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys, VisionProjectorType

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import pixtral_vision, safetensors_io, vl_text
from llmrun.loading.vision import (
    image_processor,
    positive_int,
    prefixed_weights,
    projector_type,
    three_floats,
    with_weights,
)
from llmrun.models import pixtral

MODEL_TYPE = "lighton_ocr"
# Checkpoint key prefixes of the vision parts (transformers 5's, LightOnOCR-1B's) -> the
# encoder's (Mistral 3's module names).
_HF_PREFIXES = {
    "model.vision_encoder.": "vision_tower.",
    "model.vision_projection.": "multi_modal_projector.",
}


@dataclass
class LightOnOcrVision:
    """A loaded LightOnOCR image encoder and how images are prepared for it: resized to fit
    `longest_edge`, each side rounded up to a multiple of `unit` pixels, normalized by mean
    and std."""

    encoder: pixtral.ImageEncoder
    longest_edge: int
    unit: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def has_vision(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config.json is that of a LightOnOCR with its vision tower."""
    if not isinstance(config.get("vision_config"), dict):
        return False
    if config.get("model_type") == MODEL_TYPE:
        return True
    architectures = config.get("architectures") or [None]
    return (
        config.get("model_type") == pixtral_vision.MODEL_TYPE
        and architectures[0] == vl_text.LIGHTONOCR_ARCHITECTURE
    )


def folder_has_vision(path: Path) -> bool:
    """Whether `path` is a Hugging Face folder of a LightOnOCR with its vision tower."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and has_vision(safetensors_io.read_json(config))


def is_mmproj(path: str | Path) -> bool:
    """Whether a GGUF is an mmproj of projector type lightonocr (read_gguf's checks)."""
    return projector_type(path) == VisionProjectorType.LIGHTONOCR


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen3's, which LightOnOCR's text is."""
    return config.get("model_type") == "qwen3"


def from_hf_dir(path: Path, text_hidden: int) -> LightOnOcrVision:
    """LightOnOCR's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not has_vision(config):
        raise UsageError(f"{path}: not a LightOnOCR folder with a vision_config")
    vision, text = config["vision_config"], config.get("text_config")
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a LightOnOCR config without its text_config's width")
    args = pixtral.EncoderArgs(
        pixtral.VisionArgs.from_config(vision),
        text["hidden_size"],
        config.get("spatial_merge_size", 2),
        # LightOnOcrMultiModalProjector: nn.GELU, no biases, the text's RMSNorm epsilon
        norm_eps=text.get("rms_norm_eps") or 1e-6,  # Qwen3Config's default
    )
    weights = prefixed_weights(path, _HF_PREFIXES)
    source, settings = image_processor(path)
    size = settings.get("size", {"longest_edge": args.vision.image_size})
    longest = size.get("longest_edge") if isinstance(size, dict) else None
    unit = settings.get("patch_size", args.unit)
    if isinstance(unit, dict) and unit.get("height") == unit.get("width"):
        unit = unit.get("height")
    if not positive_int(longest) or not positive_int(unit):
        raise ModelFormatError(
            f"{source}: size {size!r} and patch_size {settings.get('patch_size')!r} are not "
            "a longest_edge and a square patch in pixels"
        )
    if unit % args.vision.patch_size:
        raise ModelFormatError(
            f"{source}: images in sides of {unit} pixels, not whole patches of "
            f"{args.vision.patch_size}"
        )
    mean = three_floats(settings.get("image_mean", pixtral_vision.CLIP_MEAN), source, "image_mean")
    std = three_floats(settings.get("image_std", pixtral_vision.CLIP_STD), source, "image_std")
    encoder = _encoder(args, weights, text_hidden, path, longest)
    return LightOnOcrVision(encoder, longest, unit, mean, std)


def from_mmproj(path: str | Path, text_hidden: int) -> LightOnOcrVision:
    """The image encoder of llama.cpp's mmproj GGUF (projector type lightonocr): images
    fit in its preproc_image_size, else its image_size (clip.cpp's), in sides of a merged
    token's."""
    args, weights, mean, std, gg = pixtral_vision.read_mmproj(
        path, VisionProjectorType.LIGHTONOCR, "LightOnOCR"
    )
    longest = gg.metadata.get(Keys.ClipVision.PREPROC_IMAGE_SIZE, args.vision.image_size)
    if not positive_int(longest):
        raise ModelFormatError(
            f"{gg.path}: metadata {Keys.ClipVision.PREPROC_IMAGE_SIZE!r} is {longest!r}"
        )
    encoder = _encoder(args, weights, text_hidden, gg.path, longest)
    return LightOnOcrVision(encoder, longest, args.unit, mean, std)


def _encoder(
    args: pixtral.EncoderArgs,
    weights: dict[str, Any],
    text_hidden: int,
    source: Path,
    longest_edge: int,
) -> pixtral.ImageEncoder:
    """The encoder with `weights` (checked against its shapes), in f32."""
    if longest_edge < args.unit:
        raise ModelFormatError(
            f"{source}: images fit in {longest_edge} pixels, less than a token's {args.unit}"
        )
    return with_weights(
        pixtral.ImageEncoder, args, weights, source, (args.text_hidden_size, text_hidden)
    )
