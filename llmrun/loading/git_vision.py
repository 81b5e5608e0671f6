"""GIT's image encoder (llmrun.models.git_vision) from the Hugging Face folder of a
GitForCausalLM (git.image_encoder.*, git.visual_projection.*), with its image processor's
settings: CLIPImageProcessor's (the shorter side resized, bicubic, a centre crop to the
tower's square, CLIP's mean and std), as LLaVA's are read. Folders only: llama.cpp has no
converter for GIT.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import git, safetensors_io
from llmrun.loading.llava_vision import _processor_settings
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.git_vision import EncoderArgs, ImageEncoder
from llmrun.models.llava_vision import VisionArgs

_PREFIXES = {"git.image_encoder.": "image_encoder.", "git.visual_projection.": "visual_projection."}


@dataclass
class GitVision:
    """A loaded GIT image encoder and CLIPImageProcessor's settings for it: the image
    resized to `size` (its shorter side, or (height, width)) with Pillow filter
    `resample`, centre-cropped to `crop` where the processor crops, normalized."""

    encoder: ImageEncoder
    size: int | tuple[int, int]
    crop: tuple[int, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: int

    @property
    def tokens_per_image(self) -> int:
        return self.encoder.args.vision.patches_per_side**2 + 1


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a GIT (GitForCausalLM)."""
    return safetensors_io.read_config(path).get("model_type") == git.MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no GIT mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> GitVision:
    """Refused: there is no GIT mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no GIT image encoder; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is GIT's text decoder."""
    return config.get("model_type") == git.MODEL_TYPE


def from_hf_dir(path: Path, text_hidden: int) -> GitVision:
    """GIT's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != git.MODEL_TYPE:
        raise ModelFormatError(f"{path}: not a GIT folder")
    vision = config.get("vision_config") or {}
    git.image_tokens(vision, path / "config.json")  # refuses a size the patches do not tile
    # GitVisionConfig's patch_size where the file gives none, not CLIP's.
    args = EncoderArgs(VisionArgs.from_config({"patch_size": 16, **vision}), text_hidden)
    settings = _processor_settings(path, args.vision.image_size, False)
    if settings.pop("pad"):
        raise UnsupportedError(f"{path}: GIT's images are not padded to a square (do_pad)")
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(ImageEncoder, args, weights, path, (text_hidden, text_hidden))
    return GitVision(encoder, **settings)
