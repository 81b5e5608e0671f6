"""Command A Vision's image encoder: a tile of image_size pixels -> its soft tokens in the
language model's width. SigLIP's tower (llmrun.models.siglip), a pixel shuffle that folds
each downsample_factor x downsample_factor square of patches into one token (Idefics3's,
llmrun.models.idefics3_vision.pixel_shuffle), then a SwiGLU projector: linear_1 to twice
the gate's width, the second half through SiLU times the first, linear_2.

Reference: transformers/models/cohere2_vision/modeling_cohere2_vision.py
(Cohere2VisionMultiModalProjector, Cohere2VisionModel.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.idefics3_vision import pixel_shuffle

# Cohere2VisionConfig's vision_config defaults (a SigLIP tower on 512-pixel tiles).
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "image_size": 512,
    "num_hidden_layers": 27,
    "num_attention_heads": 12,
    "patch_size": 16,
}


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    downsample_factor: int = 2
    alignment_intermediate_size: int = 36864

    def __post_init__(self) -> None:
        factor = self.downsample_factor
        if factor < 1 or self.vision.patches_per_side % factor:
            raise ModelFormatError(
                f"downsample_factor {factor} does not divide the "
                f"{self.vision.patches_per_side} patches of a tile's side"
            )
        if self.alignment_intermediate_size % 2:
            raise ModelFormatError(
                f"alignment_intermediate_size {self.alignment_intermediate_size} is odd: "
                "not a SwiGLU's two halves"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Cohere2VisionForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a cohere2_vision config without vision_config or text_config")
        if "hidden_size" not in text:
            raise ModelFormatError("a text_config without hidden_size")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        return cls(
            siglip.VisionArgs.from_config(vision),
            text["hidden_size"],
            config.get("downsample_factor") or 2,
            config.get("alignment_intermediate_size") or 36864,
        )

    @property
    def tile_tokens(self) -> int:
        """The soft tokens of one tile."""
        return (self.vision.patches_per_side // self.downsample_factor) ** 2


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.factor = args.downsample_factor
        width = args.vision.hidden_size * args.downsample_factor**2
        self.linear_1 = nn.Linear(width, args.alignment_intermediate_size)
        self.linear_2 = nn.Linear(args.alignment_intermediate_size // 2, args.text_hidden_size)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x, gate = self.linear_1(pixel_shuffle(states, self.factor)).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)


class ImageEncoder(nn.Module):
    """Tiles [N, 3, image_size, image_size] -> soft tokens [N, tile_tokens, text hidden],
    with HF's module names (vision_tower, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = siglip.VisionModel(args.vision)
        self.multi_modal_projector = Projector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))
