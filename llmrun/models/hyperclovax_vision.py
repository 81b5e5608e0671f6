"""HyperCLOVA X SEED Vision's image encoder (HyperCLOVAXVisionV2Model, VideoLLaMA 3's
layout): Qwen2.5-VL's vision tower with its merger (llmrun.models.qwen2_vl_vision), then
one Linear, the projector, from the merger's width into the language model's.

Reference: transformers/models/hyperclovax_vision_v2/modular_hyperclovax_vision_v2.py
(HyperCLOVAXVisionV2Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models import qwen2_vl_vision


@dataclass
class EncoderArgs(qwen2_vl_vision.EncoderArgs):
    text_hidden_size: int = 0  # the language model's width, the projector's output


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, patch_features] of one image -> merged tokens
    [grid_h/m * grid_w/m, text_hidden_size] row by row (HF's names: vision_model.*,
    projector.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = qwen2_vl_vision.VisionModel(args)
        self.projector = nn.Linear(args.out_hidden_size, args.text_hidden_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        return self.projector(self.vision_model(patches, grid_h, grid_w))
