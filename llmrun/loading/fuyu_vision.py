"""Fuyu's image embedding (adept/fuyu-8b: no vision tower; each patch of pixels goes
through one Linear, vision_embed_tokens, into its Persimmon language model) from the
Hugging Face folder of a FuyuForCausalLM, with FuyuImageProcessor's settings. Folders
only: llama.cpp has no converter for Fuyu.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import image_processor, positive_int, prefixed_weights, with_weights

MODEL_TYPE = "fuyu"
# The Hub's files (language_model.*, vision_embed_tokens.*) and transformers 5's (model.*).
_PREFIXES = {"model.vision_embed_tokens.": "", "vision_embed_tokens.": ""}
BILINEAR = 2
# FuyuImageProcessor's defaults.
_DEFAULTS = {
    "size": {"height": 1080, "width": 1920},
    "resample": BILINEAR,
    "padding_value": 1.0,
    "padding_mode": "constant",
    "image_mean": 0.5,
    "image_std": 0.5,
    "rescale_factor": 1 / 255,
}


@dataclass
class FuyuVision:
    """A loaded patch embedding and FuyuImageProcessor's settings for it."""

    encoder: torch.nn.Linear  # [patch_size² * 3] -> the language model's width
    image_token_id: int  # the config's: the id whose places take the patches
    patch_size: int
    max_height: int  # images larger than this box are shrunk into it
    max_width: int
    resample: int
    padding_value: int  # in 0..255 pixel units: the padding is added before / 255
    mean: tuple[float, ...]
    std: tuple[float, ...]


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a Fuyu (FuyuForCausalLM)."""
    return safetensors_io.read_config(path).get("model_type") == MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Fuyu mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> FuyuVision:
    """Refused: there is no Fuyu mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Fuyu projector; give its folder")


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is one Fuyu's images go to: its Persimmon."""
    return config.get("model_type") == "persimmon"


def from_hf_dir(path: Path, text_hidden: int) -> FuyuVision:
    """Fuyu's patch embedding from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if config.get("model_type") != MODEL_TYPE:
        raise ModelFormatError(f"{path}: not a Fuyu folder")
    patch, channels = config.get("patch_size", 30), config.get("num_channels", 3)
    if not positive_int(patch):
        raise ModelFormatError(f"{path}: Fuyu's patch_size is {patch!r}")
    if channels != 3:
        raise UnsupportedError(f"{path}: Fuyu images of {channels!r} channels; RGB has 3")
    token = config.get("image_token_id", 71011)  # FuyuConfig's default
    if not positive_int(token):
        raise ModelFormatError(f"{path}: Fuyu's image_token_id is {token!r}")
    weights = prefixed_weights(path, _PREFIXES)
    shape = (patch * patch * 3, text_hidden)  # with_weights refuses a file's other widths
    encoder = with_weights(_linear, shape, weights, path, (text_hidden, text_hidden))
    return FuyuVision(encoder, token, patch, **_processor_settings(path, patch))


def _linear(shape: tuple[int, int]) -> torch.nn.Linear:
    return torch.nn.Linear(*shape)


def _processor_settings(path: Path, patch: int) -> dict[str, Any]:
    """FuyuImageProcessor's settings (its defaults where the folder gives none), refused
    where llmrun would not prepare images as it does."""
    file, settings = image_processor(path)
    settings = {**_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    for step in ("do_resize", "do_pad", "do_rescale", "do_normalize"):
        if settings.get(step, True) is not True:
            raise UnsupportedError(f"{file}: {step} is {settings[step]!r}; Fuyu's is true")
    patches = settings.get("patch_size", {"height": patch, "width": patch})
    if patches != {"height": patch, "width": patch}:
        raise ModelFormatError(
            f"{file}: patch_size {patches!r}, but the model embeds {patch}x{patch} patches"
        )
    size = settings["size"]
    if not (isinstance(size, dict) and positive_int(size.get("height"))):
        raise ModelFormatError(f"{file}: size is {size!r}")
    if not positive_int(size.get("width")):
        raise ModelFormatError(f"{file}: size is {size!r}")
    if size["height"] % patch or size["width"] % patch:
        raise ModelFormatError(f"{file}: size {size!r} is not whole {patch}-pixel patches")
    if settings["padding_mode"] != "constant":
        raise UnsupportedError(f"{file}: padding_mode {settings['padding_mode']!r}")
    pad = settings["padding_value"]
    if not isinstance(pad, int | float) or not 0 <= pad <= 255 or pad != int(pad):
        raise UnsupportedError(f"{file}: padding_value {pad!r}; llmrun pads with a byte value")
    rescale = settings["rescale_factor"]
    if not isinstance(rescale, int | float) or not abs(rescale - 1 / 255) <= 1e-12:
        raise UnsupportedError(f"{file}: rescale_factor {rescale!r}, not 1/255")
    if settings["resample"] not in range(6):
        raise ModelFormatError(f"{file}: resample is {settings['resample']!r}, not a Pillow filter")
    return dict(
        max_height=size["height"],
        max_width=size["width"],
        resample=settings["resample"],
        padding_value=int(pad),
        mean=_per_channel(settings["image_mean"], file, "image_mean"),
        std=_per_channel(settings["image_std"], file, "image_std"),
    )


def _per_channel(value: Any, file: Path, key: str) -> tuple[float, ...]:
    """A mean or std given as one number for all channels or as three."""
    values = [value] * 3 if isinstance(value, int | float) else value
    ok = isinstance(values, list | tuple) and len(values) == 3
    if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ModelFormatError(f"{file}: {key} is {value!r}, not one number or three")
    if key == "image_std" and any(v <= 0 for v in values):
        raise ModelFormatError(f"{file}: image_std is {value!r}; it divides, so must be positive")
    return tuple(float(v) for v in values)
