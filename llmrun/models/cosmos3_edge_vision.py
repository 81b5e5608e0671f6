"""Cosmos3 Edge's image encoder: an image's patches -> one token per 2x2 patches, in the
language model's width.

A SigLIP 2 tower on patches that come flattened (patch_size² pixels, their channels
innermost, through a Linear): its learned square table of positions resized to the image's
grid of patches (bilinear, antialiased), SigLIP's encoder layers (every patch of the image
seeing every other; llmrun.models.siglip), a final LayerNorm; then Qwen3.5's patch merger
as the projector: each patch normalized, each 2x2 group concatenated, Linear-GELU-Linear.

The patches come in the order Cosmos3EdgeImageProcessor flattens them: 2x2 groups row by
row, the 4 patches of a group together (llmrun.cosmos3_edge_images).

Reference: transformers/models/cosmos3_edge/modular_cosmos3_edge.py
(Cosmos3EdgeVisionEmbeddings, Cosmos3EdgeVisionModel, Cosmos3EdgePatchMerger).
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

PROJECTOR_EPS = 1e-6  # Cosmos3EdgePatchMerger's LayerNorm


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_patches: int  # the learned table's positions, a square
    projector_hidden_size: int
    text_hidden_size: int
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 1  # a still image is one frame
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        side = math.isqrt(self.num_patches)
        if side * side != self.num_patches:
            raise ModelFormatError(f"vision num_patches {self.num_patches} is not a square")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden: int) -> EncoderArgs:
        """From a Cosmos3EdgeForConditionalGeneration's config.json dict."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("a cosmos3_edge config.json without a vision_config")
        # Cosmos3EdgeVisionConfig's and Cosmos3EdgeConfig's defaults
        defaults = dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_patches=256,
            patch_size=16,
            spatial_merge_size=2,
            num_channels=3,
            layer_norm_eps=1e-6,
            hidden_act="gelu_pytorch_tanh",
        )
        values = {k: vision.get(k, v) for k, v in defaults.items()}
        return cls(
            **values,
            projector_hidden_size=config.get("projector_hidden_size", 11520),
            text_hidden_size=text_hidden,
        )

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_patches)

    @property
    def patch_features(self) -> int:
        return self.num_channels * self.patch_size**2


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedding = nn.Linear(args.patch_features, args.hidden_size)
        self.position_embedding = nn.Embedding(args.num_patches, args.hidden_size)

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """The learned table resized to grid_h x grid_w [grid_h * grid_w, hidden], in the
        patches' order (2x2 groups row by row)."""
        side, merge = self.args.position_side, self.args.spatial_merge_size
        # [side*side, hidden] -> [1, hidden, side, side]
        table = self.position_embedding.weight.float().view(side, side, -1).permute(2, 0, 1)
        resized = F.interpolate(
            table[None], size=(grid_h, grid_w), mode="bilinear", align_corners=False, antialias=True
        )
        # [1, hidden, h, w] -> [h/m, m, w/m, m, hidden] -> groups row by row
        grid = (
            resized[0].permute(1, 2, 0).reshape(grid_h // merge, merge, grid_w // merge, merge, -1)
        )
        return grid.transpose(1, 2).reshape(grid_h * grid_w, -1)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        return self.patch_embedding(patches) + self.positions(grid_h, grid_w).to(patches.dtype)


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            siglip.EncoderLayer(args) for _ in range(args.num_hidden_layers)
        )


class VisionTower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = self.embeddings(patches, grid_h, grid_w)[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x[0])


class Projector(nn.Module):
    """Each patch normalized, each 2x2 group's patches concatenated, Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.norm = nn.LayerNorm(args.hidden_size, eps=PROJECTOR_EPS)
        self.linear_fc1 = nn.Linear(self.width, args.projector_hidden_size)
        self.linear_fc2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.width))))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, patch_features] of one image -> merged tokens
    [grid_h/m * grid_w/m, text_hidden_size] row by row (HF's names: visual.*, projector.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.visual = VisionTower(args)
        self.projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        return self.projector(self.visual(patches, grid_h, grid_w))
