"""The vision-language families that take images, one table entry each: how a family's
image encoder is recognized and loaded (its Hugging Face folder, or llama.cpp's mmproj GGUF
beside a text GGUF), how many prompt tokens an image takes, how images are encoded, and how
a prompt's image places are expanded for them. The engine (llmrun.api) dispatches through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun import multimodal, pixtral_images, qwen2_vl_images
from llmrun.loading import pixtral_vision, qwen2_vl_vision, safetensors_io
from llmrun.loading import vision as gemma3_vision
from llmrun.tokenizer import Tokenizer

# A prompt's ids and its images as generate() takes them (multimodal.PromptImages or a
# family's subclass).
Prompt = tuple[list[int], multimodal.PromptImages]
EmbedToken = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class VisionFamily:
    """One family's image handling; `vision` below is what its loaders return."""

    name: str  # as messages name it: "Gemma 3"
    vision_type: type
    # Whether a Hugging Face folder / an mmproj GGUF holds this family's image encoder.
    folder_has_vision: Callable[[Path], bool]
    is_mmproj: Callable[[Path], bool]
    # The encoder from a folder / an mmproj, for a language model `text_hidden` wide.
    from_hf_dir: Callable[[Path, int], Any]
    from_mmproj: Callable[[Path, int], Any]
    # Whether a language model's config takes this family's images (None: any does).
    text_takes_images: Callable[[dict[str, Any]], bool] | None
    # The prompt tokens an (opened, Pillow) image takes, before it is encoded.
    image_tokens: Callable[[Any, Any], int]
    # Each opened image's encoding, in order.
    encode: Callable[[Any, Sequence[Any]], list[torch.Tensor]]
    # The ids of a text whose image places take the encoded images, and those images.
    prompt: Callable[[Any, Tokenizer, str, Sequence[torch.Tensor], EmbedToken], Prompt]


def _gemma3_prompt(
    vision: gemma3_vision.Vision,
    tokenizer: Tokenizer,
    text: str,
    embeds: Sequence[torch.Tensor],
    embed_token: EmbedToken,
) -> Prompt:
    ids, starts = multimodal.expand(tokenizer, text, len(embeds), vision.tokens_per_image)
    return ids, multimodal.PromptImages(list(embeds), starts)


def _pixtral_prompt(
    vision: pixtral_vision.PixtralVision,
    tokenizer: Tokenizer,
    text: str,
    embeds: Sequence[torch.Tensor],
    embed_token: EmbedToken,
) -> Prompt:
    return pixtral_images.prompt(tokenizer, text, embeds, embed_token)


def _qwen2_vl_prompt(
    vision: qwen2_vl_vision.QwenVision,
    tokenizer: Tokenizer,
    text: str,
    embeds: Sequence[torch.Tensor],
    embed_token: EmbedToken,
) -> Prompt:
    return qwen2_vl_images.prompt(tokenizer, text, embeds)


def _gemma3_folder(path: Path) -> bool:
    return gemma3_vision.has_vision(safetensors_io.read_config(path))


FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily(
        name="Gemma 3",
        vision_type=gemma3_vision.Vision,
        folder_has_vision=_gemma3_folder,
        is_mmproj=gemma3_vision.is_mmproj,
        from_hf_dir=gemma3_vision.from_hf_dir,
        from_mmproj=gemma3_vision.from_mmproj,
        text_takes_images=lambda config: config.get("model_type") == "gemma3_text",
        image_tokens=lambda vision, image: vision.tokens_per_image,
        encode=multimodal.encode,
        prompt=_gemma3_prompt,
    ),
    VisionFamily(
        name="Mistral 3",
        vision_type=pixtral_vision.PixtralVision,
        folder_has_vision=pixtral_vision.folder_has_vision,
        is_mmproj=pixtral_vision.is_mmproj,
        from_hf_dir=pixtral_vision.from_hf_dir,
        from_mmproj=pixtral_vision.from_mmproj,
        text_takes_images=None,
        image_tokens=pixtral_images.image_tokens,
        encode=pixtral_images.encode,
        prompt=_pixtral_prompt,
    ),
    VisionFamily(
        name="Qwen2-VL/2.5-VL",
        vision_type=qwen2_vl_vision.QwenVision,
        folder_has_vision=qwen2_vl_vision.folder_has_vision,
        is_mmproj=qwen2_vl_vision.is_mmproj,
        from_hf_dir=qwen2_vl_vision.from_hf_dir,
        from_mmproj=qwen2_vl_vision.from_mmproj,
        text_takes_images=qwen2_vl_vision.turns_by_mrope,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_qwen2_vl_prompt,
    ),
)

# How messages list the families: "Gemma 3, Mistral 3 and Qwen2-VL/2.5-VL".
NAMES = ", ".join(f.name for f in FAMILIES[:-1]) + f" and {FAMILIES[-1].name}"


def of_vision(vision: Any) -> VisionFamily:
    """The family of a loaded image encoder."""
    return next(f for f in FAMILIES if isinstance(vision, f.vision_type))


def of_folder(path: Path) -> VisionFamily | None:
    """The family whose image encoder a Hugging Face folder holds, if any."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    return next((f for f in FAMILIES if f.folder_has_vision(path)), None)


def of_mmproj(path: Path) -> VisionFamily | None:
    """The family of an mmproj GGUF's projector, if llmrun runs it."""
    return next((f for f in FAMILIES if f.is_mmproj(path)), None)
