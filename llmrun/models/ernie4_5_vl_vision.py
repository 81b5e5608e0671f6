"""ERNIE 4.5 VL's image encoder: an image's patches (in the processor's order, each 2x2
group together) -> soft tokens in the language model's width, one per 2x2 patches. Its
tower is Qwen2-VL's blocks (llmrun.models.qwen2_vl_vision: LayerNorms, the 2D RoPE,
whole-image attention) after a bias-free linear patch embedding of single frames, then a
LayerNorm; its variable-resolution resampler concatenates each 2x2 group, runs it through
Linear-GELU-Linear-LayerNorm (spatial_linear), concatenates it with itself (an image is
one frame, which the temporal merge of 2 duplicates) through another such stack
(temporal_linear), projects it to the language model's width (mlp) and RMS-normalizes it
(after_norm).

Reference: transformers/models/ernie4_5_vl_moe/modular_ernie4_5_vl_moe.py
(Ernie4_5_VLMoeVisionTransformerPretrainedModel, Ernie4_5_VLMoeVariableResolutionResamplerModel).
Module names are the Hub checkpoints' (vision_model.*, resampler_model.spatial_linear.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models.base import RMSNorm
from llmrun.models.qwen2_vl_vision import Block, EncoderArgs, rotary_angles

EPS = 1e-6  # the vision config's rms_norm_eps, which its LayerNorms take


@dataclass
class ResamplerArgs:
    tower: EncoderArgs  # Qwen2-VL's blocks, temporal_patch_size 1
    text_hidden_size: int
    text_norm_eps: float  # after_norm's: the language model's rms_norm_eps
    temporal_merge_size: int = 2

    # qwen2_vl_images reads the patch sizes from the encoder's args.
    @property
    def patch_size(self) -> int:
        return self.tower.patch_size

    @property
    def spatial_merge_size(self) -> int:
        return self.tower.spatial_merge_size

    @property
    def temporal_patch_size(self) -> int:
        return self.tower.temporal_patch_size


class PatchEmbed(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.proj = nn.Linear(args.patch_features, args.hidden_size, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class Tower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.ln = nn.LayerNorm(args.hidden_size, eps=EPS)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = self.patch_embed(patches)
        cos, sin = rotary_angles(self.args, grid_h, grid_w)
        for block in self.blocks:
            x = block(x, cos, sin, [len(x)])
        return self.ln(x)


def _stack(inputs: int, width: int) -> nn.Sequential:
    """Linear-GELU-Linear-LayerNorm, its modules numbered as the checkpoints' (0, 2, 3)."""
    return nn.Sequential(
        nn.Linear(inputs, width), nn.GELU(), nn.Linear(width, width), nn.LayerNorm(width, eps=EPS)
    )


class Resampler(nn.Module):
    def __init__(self, args: ResamplerArgs) -> None:
        super().__init__()
        spatial = args.tower.hidden_size * args.spatial_merge_size**2
        self.spatial_linear = _stack(spatial, spatial)
        self.temporal_linear = _stack(spatial * args.temporal_merge_size, spatial)
        self.mlp = nn.Linear(spatial, args.text_hidden_size)
        self.after_norm = RMSNorm(args.text_hidden_size, args.text_norm_eps)
        self.frames = args.temporal_merge_size

    def forward(self, x: torch.Tensor, unit: int) -> torch.Tensor:
        # [N, hidden] -> [N / unit, unit * hidden]: each 2x2 group's patches side by side
        x = self.spatial_linear(x.reshape(-1, x.shape[-1] * unit))
        x = self.temporal_linear(torch.cat([x] * self.frames, dim=-1))
        return self.after_norm(self.mlp(x))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, 3 * patch²] of one image -> soft tokens
    [grid_h/m * grid_w/m, text hidden] row by row."""

    def __init__(self, args: ResamplerArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = Tower(args.tower)
        self.resampler_model = Resampler(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = self.vision_model(patches, grid_h, grid_w)
        return self.resampler_model(x, self.args.spatial_merge_size**2)
