"""Gemma 3's image encoder: an image -> mm_tokens_per_image soft tokens in the language
model's width. SigLIP's patch states (llmrun.models.siglip), average-pooled over square
groups of patches (64x64 patches to 16x16 tokens for 896-pixel images), RMS-normalized
(Gemma's x * (1 + w)) and multiplied by a projection matrix.

Reference: transformers/models/gemma3/modeling_gemma3.py (Gemma3MultiModalProjector,
Gemma3Model.get_image_features).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.base import GemmaRMSNorm


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden_size: int
    mm_tokens_per_image: int = 256

    def __post_init__(self) -> None:
        side = math.isqrt(self.mm_tokens_per_image)
        patches = self.vision.patches_per_side
        if side * side != self.mm_tokens_per_image or side < 1 or patches % side:
            raise ModelFormatError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square that divides "
                f"the {patches}x{patches} patches of an image"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Gemma3ForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a Gemma 3 config without vision_config and text_config")
        return cls(
            siglip.VisionArgs.from_config(vision),
            text["hidden_size"],
            config.get("mm_tokens_per_image") or 256,
        )

    @property
    def pool(self) -> int:
        """The side of each square of patches averaged into one token."""
        return self.vision.patches_per_side // math.isqrt(self.mm_tokens_per_image)


class MultiModalProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        vision = args.vision
        self.pool = args.pool
        self.side = vision.patches_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, args.text_hidden_size)
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = states.shape
        # [N, patches, hidden] -> [N, hidden, side, side] -> pooled [N, tokens, hidden]
        grid = states.transpose(1, 2).reshape(batch, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class ImageEncoder(nn.Module):
    """Pixels [N, 3, image_size, image_size] -> soft tokens [N, mm_tokens_per_image,
    text hidden], with HF's module names (vision_tower, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = siglip.VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))
