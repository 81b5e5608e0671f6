"""PaliGemma's image encoder: SigLIP's vision tower, then one linear layer to the language
model's width, one soft token a patch (PaliGemmaMultiModalProjector; transformers 5 no
longer divides the features by sqrt(hidden), as its Gemma embedding scales only the ids').

Reference: transformers/models/paligemma/modeling_paligemma.py (get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models import siglip


@dataclass
class EncoderArgs:
    vision: siglip.VisionArgs
    projection_dim: int

    @property
    def tokens_per_image(self) -> int:
        return self.vision.patches_per_side**2


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.linear = nn.Linear(args.vision.hidden_size, args.projection_dim)


class ImageEncoder(nn.Module):
    """Pixels [N, 3, S, S] -> soft tokens [N, patches, projection_dim], with HF's module
    names (vision_tower.vision_model.*, multi_modal_projector.linear)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = siglip.VisionModel(args.vision)
        self.multi_modal_projector = Projector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector.linear(self.vision_tower(pixels))
