"""Ovis2.5's visual tokenizer (llmrun.models.ovis2_5_vision) from its Hugging Face folder:
Ovis2_5ForConditionalGeneration's config.json (model_type ovis2_5; its image token ids),
the tensors under the names Ovis2.5's own code gives them and save_pretrained writes
(visual_tokenizer.vit.vision_model.*, visual_tokenizer.head.*, vte.weight: transformers'
conversion mapping), and Ovis2_5ImageProcessor's preprocessor_config.json. Its images go to a Qwen3
language model (llmrun.models.qwen3). llama.cpp has no converter for it: no mmproj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import qwen2_vl_vision, safetensors_io
from llmrun.loading.vision import prefixed_weights, with_weights
from llmrun.models.ovis2_5_vision import EncoderArgs, VisionModel

MODEL_TYPE = "ovis2_5"
TEXT_MODEL_TYPE = "qwen3"
# Ovis2_5ImageProcessor's: IMAGENET_STANDARD_MEAN and _STD, 448x448 to 1344x1792 pixels.
MEAN = STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 448 * 448, 1344 * 1792
# Ovis2_5Config's defaults: the image place, and the tokens that open and close an image.
TOKEN_IDS = {"image_token_id": 151655, "image_start_token_id": 151670, "image_end_token_id": 151671}
# The files' names -> llmrun.models.ovis2_5_vision's. The tower's post_layernorm is left
# out: the features never go through it (the last block's output is read, by
# transformers' get_image_features as by Ovis2.5's own code).
_PREFIXES = {
    "visual_tokenizer.vit.vision_model.embeddings.": "vision_tower.embeddings.",
    "visual_tokenizer.vit.vision_model.encoder.layers.": "vision_tower.layers.",
    "visual_tokenizer.head.0.": "multi_modal_projector.visual_tokenizer.linear.",
    "visual_tokenizer.head.1.": "multi_modal_projector.visual_tokenizer.norm.",
    "vte.": "multi_modal_projector.visual_embeddings_table.",
}


@dataclass
class Ovis25Vision:
    """A loaded Ovis2.5 visual tokenizer, how images are prepared for it and the ids of
    the tokens that place an image in a prompt."""

    encoder: VisionModel
    image_token_id: int
    image_start_token_id: int
    image_end_token_id: int
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS


def folder_has_vision(path: Path) -> bool:
    """Whether a Hugging Face folder is an Ovis2.5's with its vision_config."""
    config = safetensors_io.read_config(path)
    return config.get("model_type") == MODEL_TYPE and isinstance(config.get("vision_config"), dict)


def text_takes_images(text_config: dict[str, Any]) -> bool:
    """Whether a language model's config is a Qwen3's (Ovis2.5's text model)."""
    return text_config.get("model_type") == TEXT_MODEL_TYPE


def no_mmproj(path: str | Path) -> bool:
    """llama.cpp writes no Ovis2.5 mmproj: never one of its."""
    return False


def from_mmproj(path: str | Path, text_hidden: int) -> Ovis25Vision:
    """Refused: there is no Ovis2.5 mmproj to read."""
    raise UnsupportedError(f"{path}: llama.cpp has no Ovis2.5 projector; give its folder")


def from_hf_dir(path: Path, text_hidden: int) -> Ovis25Vision:
    """The visual tokenizer of an Ovis2.5 folder (f32, on the CPU)."""
    config = safetensors_io.read_config(path)
    try:
        args = EncoderArgs.from_config(config)
    except (ModelFormatError, UnsupportedError) as e:
        raise type(e)(f"{path}: {e}") from None
    ids = {}
    for key, default in TOKEN_IDS.items():
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ModelFormatError(f"{path}: config.json's {key} is {value!r}")
        ids[key] = value
    weights = prefixed_weights(path, _PREFIXES)
    encoder = with_weights(VisionModel, args, weights, path, (args.text_hidden_size, text_hidden))
    settings = qwen2_vl_vision.processor_settings(path, args, MEAN, STD, MIN_PIXELS, MAX_PIXELS)
    return Ovis25Vision(encoder, **ids, **settings)
