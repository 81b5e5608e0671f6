"""GOT-OCR 2.0's image encoder (llmrun.models.got_ocr2_vision) from the Hugging Face folder
of a GotOcr2ForConditionalGeneration (stepfun-ai/GOT-OCR-2.0-hf, as transformers 5 saves
it), with its image processor's settings (GotOcr2ImageProcessor: a square size, bicubic,
OpenAI CLIP's mean and std by default). llama.cpp's converter writes no GOT-OCR 2.0 mmproj.

The checkpoint's SAM names (vision_tower.layers.N.layer_norm1, neck.conv1, ...) become
llmrun's SAM's (the original SAM's, as DeepSeek-OCR 2 keeps them); its projector's two
convolutions are that SAM's net_2 and net_3.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import safetensors_io
from llmrun.loading.vision import image_processor, positive_int, three_floats, with_weights
from llmrun.models.deepseek_ocr2_vision import SamArgs
from llmrun.models.got_ocr2_vision import EncoderArgs, ImageEncoder

MODEL_TYPE = "got_ocr2"
TEXT_MODEL_TYPE = "qwen2"
# GotOcr2ImageProcessor's defaults (OPENAI_CLIP_MEAN and _STD; its size 384, the Hub's 1024).
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3
# The grid's downsampling by the two stride-2 convolutions.
_DOWNSAMPLE = 4
# Checkpoint names (the Hub's, and transformers 5's under model.) -> the encoder's, in
# order: the first that matches.
_RENAMES = (
    (r"vision_tower\.patch_embed\.projection\.", "sam.patch_embed.proj."),
    (r"vision_tower\.pos_embed$", "sam.pos_embed"),
    (r"vision_tower\.layers\.(\d+)\.layer_norm([12])\.", r"sam.blocks.\1.norm\2."),
    (r"vision_tower\.layers\.(\d+)\.(attn|mlp)\.", r"sam.blocks.\1.\2."),
    (r"vision_tower\.neck\.conv1\.", "sam.neck.0."),
    (r"vision_tower\.neck\.layer_norm1\.", "sam.neck.1."),
    (r"vision_tower\.neck\.conv2\.", "sam.neck.2."),
    (r"vision_tower\.neck\.layer_norm2\.", "sam.neck.3."),
    (r"multi_modal_projector\.conv_upsampler1\.", "sam.net_2."),
    (r"multi_modal_projector\.conv_upsampler2\.", "sam.net_3."),
    (r"multi_modal_projector\.multimodal_projector\.", "projector."),
)


@dataclass
class GotOcr2Vision:
    """A loaded GOT-OCR 2.0 image encoder and how images are prepared for it: resized to
    `size` pixels square (bicubic), normalized; each takes `tokens` prompt tokens."""

    encoder: ImageEncoder
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    tokens: int


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is a GOT-OCR 2.0's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen2's (GOT-OCR 2.0's text model)."""
    return config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no GOT-OCR 2.0 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> GotOcr2Vision:
    """Refused: there is no GOT-OCR 2.0 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no GOT-OCR 2.0 projector; give its folder")


def encoder_args(config: dict[str, Any], path: Path) -> EncoderArgs:
    """The encoder's shape from a GOT-OCR 2.0 config.json (GotOcr2VisionConfig's defaults
    where it leaves fields out)."""
    vision, text = config["vision_config"], config.get("text_config")
    if not isinstance(text, dict) or not positive_int(text.get("hidden_size")):
        raise ModelFormatError(f"{path}: a GOT-OCR 2.0 config without its text_config's width")
    for name, runs in (
        ("use_abs_pos", True),
        ("use_rel_pos", True),
        ("qkv_bias", True),
        ("hidden_act", "gelu"),
        ("num_channels", 3),
    ):
        if vision.get(name, runs) != runs:
            raise UnsupportedError(
                f"{path}: vision_config.{name} {vision[name]!r} is not supported ({runs!r})"
            )
    names = {f.name for f in dataclasses.fields(SamArgs)} - {"downsample_channels"}
    sam = SamArgs(**{k: v for k, v in vision.items() if k in names and v is not None})
    for name in ("hidden_size", "output_channels", "num_attention_heads", "image_size"):
        if not positive_int(getattr(sam, name)):
            raise ModelFormatError(f"{path}: vision_config.{name} is {getattr(sam, name)!r}")
    if not positive_int(sam.patch_size) or sam.image_size % (sam.patch_size * _DOWNSAMPLE):
        raise ModelFormatError(
            f"{path}: vision_config.image_size {sam.image_size} is not a whole number of "
            f"{_DOWNSAMPLE}x{_DOWNSAMPLE} patches of {sam.patch_size!r} pixels"
        )
    sam.downsample_channels = [2 * sam.output_channels, text["hidden_size"]]
    return EncoderArgs(sam, text["hidden_size"])


def _encoder_weights(path: Path) -> dict[str, torch.Tensor]:
    """The folder's vision tower and projector tensors under the encoder's names."""
    weights = {}
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file).items():
            for pattern, new in _RENAMES:
                renamed, found = re.subn(r"^(?:model\.)?" + pattern, new, name)
                if found:
                    weights[renamed] = tensor
                    break
    return weights


def from_hf_dir(path: Path, text_hidden: int) -> GotOcr2Vision:
    """GOT-OCR 2.0's image encoder from its Hugging Face folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    if not folder_has_vision(path):
        raise UsageError(f"{path}: not a GOT-OCR 2.0 folder with a vision_config")
    args = encoder_args(config, path)
    source, settings = image_processor(path)
    side = settings.get("size", {"height": args.sam.image_size, "width": args.sam.image_size})
    size = side.get("height") if isinstance(side, dict) else None
    if not isinstance(side, dict) or size != side.get("width") or size != args.sam.image_size:
        raise ModelFormatError(
            f"{source}: size is {side!r}, not the vision tower's {args.sam.image_size} square"
        )
    if settings.get("crop_to_patches", False):
        raise UnsupportedError(
            f"{source}: crop_to_patches true (llmrun prepares the whole image, the "
            "processor's default)"
        )
    if settings.get("resample", _BICUBIC) != _BICUBIC:
        raise UnsupportedError(f"{source}: resample {settings['resample']!r} (llmrun's: bicubic)")
    mean = three_floats(settings.get("image_mean", _MEAN), source, "image_mean")
    std = three_floats(settings.get("image_std", _STD), source, "image_std")
    encoder = with_weights(
        ImageEncoder, args, _encoder_weights(path), path, (args.text_hidden_size, text_hidden)
    )
    tokens = (size // args.sam.patch_size // _DOWNSAMPLE) ** 2
    return GotOcr2Vision(encoder, size, mean, std, tokens)
