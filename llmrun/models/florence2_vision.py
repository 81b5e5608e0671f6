"""Florence-2's image encoder: a DaViT backbone (stages of a strided convolution, then blocks
of a spatial part, window attention, and a channel part, attention across channel groups,
each after a depthwise convolution) and the projector that turns its last grid into the
BART encoder's image tokens: learned row and column embeddings added, the grid's mean
first (with the first sinusoidal "temporal" position), then each cell, projected and
normalized. One image -> [1 + rows * columns, projection_dim].

Reference: transformers/models/florence2/modeling_florence2.py (Florence2VisionBackbone,
Florence2VisionSpatialBlock, Florence2VisionChannelBlock, Florence2MultiModalProjector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation

_STAGE_FIELDS = (
    "depths",
    "patch_size",
    "patch_stride",
    "patch_padding",
    "patch_prenorm",
    "embed_dim",
    "num_heads",
    "num_groups",
)


@dataclass(frozen=True)
class VisionArgs:
    """Florence2VisionConfig's fields (one entry per stage in the tuples), by its names."""

    depths: tuple[int, ...] = (1, 1, 9, 1)
    patch_size: tuple[int, ...] = (7, 3, 3, 3)
    patch_stride: tuple[int, ...] = (4, 2, 2, 2)
    patch_padding: tuple[int, ...] = (3, 1, 1, 1)
    patch_prenorm: tuple[bool, ...] = (False, True, True, True)
    embed_dim: tuple[int, ...] = (128, 256, 512, 1024)
    num_heads: tuple[int, ...] = (4, 8, 16, 32)
    num_groups: tuple[int, ...] = (4, 8, 16, 32)
    window_size: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    activation_function: str = "gelu"
    projection_dim: int = 1024
    max_temporal_embeddings: int = 100
    max_position_embeddings: int = 50

    @classmethod
    def from_config(cls, vision: dict[str, Any]) -> VisionArgs:
        """From a Florence2Config's vision_config; the per-stage lists checked alike long."""
        known = {f for f in cls.__dataclass_fields__ if f in vision}
        values = {k: tuple(vision[k]) if k in _STAGE_FIELDS else vision[k] for k in known}
        args = cls(**values)
        stages = {len(getattr(args, k)) for k in _STAGE_FIELDS}
        if len(stages) != 1:
            raise ModelFormatError(
                f"vision_config: {', '.join(_STAGE_FIELDS)} give different numbers of stages"
            )
        for dim, heads, groups in zip(args.embed_dim, args.num_heads, args.num_groups, strict=True):
            if dim % heads or dim % groups:
                raise ModelFormatError(
                    f"vision_config: embed_dim {dim} is not a multiple of its heads {heads} "
                    f"and groups {groups}"
                )
        activation(args.activation_function)
        return args

    @property
    def stride(self) -> int:
        """How many pixels one cell of the last grid spans."""
        return math.prod(self.patch_stride)


class ConvEmbed(nn.Module):
    """A stage's strided convolution, its LayerNorm before (prenorm) or after it."""

    def __init__(self, args: VisionArgs, stage: int) -> None:
        super().__init__()
        channels = 3 if stage == 0 else args.embed_dim[stage - 1]
        dim = args.embed_dim[stage]
        self.pre_norm = args.patch_prenorm[stage]
        self.conv = nn.Conv2d(
            channels,
            dim,
            args.patch_size[stage],
            args.patch_stride[stage],
            args.patch_padding[stage],
        )
        self.norm = nn.LayerNorm(channels if self.pre_norm else dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = self.conv(x)
        if not self.pre_norm:
            x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x


class MLP(nn.Module):
    def __init__(self, args: VisionArgs, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, int(dim * args.mlp_ratio))
        self.fc2 = nn.Linear(int(dim * args.mlp_ratio), dim)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class WindowAttention(nn.Module):
    """Attention within window_size x window_size windows of the grid (padded at the bottom
    and right to whole windows); x [B, H, W, C] -> [B, H*W, C]."""

    def __init__(self, args: VisionArgs, stage: int) -> None:
        super().__init__()
        dim = args.embed_dim[stage]
        self.heads, self.window = args.num_heads[stage], args.window_size
        self.qkv = nn.Linear(dim, dim * 3, bias=args.qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        size = self.window
        x = F.pad(x, (0, 0, 0, (size - w % size) % size, 0, (size - h % size) % size))
        rows, columns = x.shape[1] // size, x.shape[2] // size
        # [B, rows*size, columns*size, C] -> [B*rows*columns, size*size, C]
        windows = x.view(b, rows, size, columns, size, c).permute(0, 1, 3, 2, 4, 5)
        windows = windows.reshape(-1, size * size, c)
        n = windows.shape[0]
        qkv = self.qkv(windows).view(n, size * size, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # scale (c / heads) ** -0.5
        out = self.proj(out.transpose(1, 2).reshape(n, size * size, c))
        out = out.view(b, rows, columns, size, size, c).permute(0, 1, 3, 2, 4, 5)
        out = out.reshape(b, rows * size, columns * size, c)[:, :h, :w]
        return out.reshape(b, h * w, c)


class ChannelAttention(nn.Module):
    """Attention among the channels of each of num_groups groups, every token a feature
    (scaled by tokens**-0.5); x [B, N, C] -> [B, N, C]."""

    def __init__(self, args: VisionArgs, stage: int) -> None:
        super().__init__()
        dim = args.embed_dim[stage]
        self.groups = args.num_groups[stage]
        self.qkv = nn.Linear(dim, dim * 3, bias=args.qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        # [B, N, 3, G, C/G] -> 3 x [B, G, C/G, N]: channels as queries, tokens as features
        qkv = self.qkv(x).view(b, n, 3, self.groups, c // self.groups)
        q, k, v = qkv.permute(2, 0, 3, 4, 1).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=n**-0.5)
        return self.proj(out.permute(0, 3, 1, 2).reshape(b, n, c))


class Block(nn.Module):
    """A spatial or channel block: x + depthwise conv, then x + attention(norm1(x)), then x +
    depthwise conv, then x + ffn(norm2(x)); x [B, C, H, W]."""

    def __init__(self, args: VisionArgs, stage: int, attention: nn.Module, name: str) -> None:
        super().__init__()
        dim = args.embed_dim[stage]
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = nn.LayerNorm(dim)
        setattr(self, name, attention)
        self.attention_name = name
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = MLP(args, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        x = self.conv1(x) + x
        tokens = x.flatten(2).transpose(1, 2)  # [B, H*W, C]
        normed = self.norm1(tokens)
        if self.attention_name == "window_attn":
            normed = normed.view(b, h, w, c)
        tokens = tokens + getattr(self, self.attention_name)(normed)
        x = tokens.transpose(1, 2).reshape(b, c, h, w)
        x = self.conv2(x) + x
        tokens = x.flatten(2).transpose(1, 2)
        tokens = tokens + self.ffn(self.norm2(tokens))
        return tokens.transpose(1, 2).reshape(b, c, h, w)


class StageBlock(nn.Module):
    def __init__(self, args: VisionArgs, stage: int) -> None:
        super().__init__()
        self.spatial_block = Block(args, stage, WindowAttention(args, stage), "window_attn")
        self.channel_block = Block(args, stage, ChannelAttention(args, stage), "channel_attn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.channel_block(self.spatial_block(x))


class Backbone(nn.Module):
    """Florence2VisionBackbone: pixels [B, 3, H, W] -> the last stage's grid [B, C, h, w]."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        stages = range(len(args.embed_dim))
        self.convs = nn.ModuleList(ConvEmbed(args, s) for s in stages)
        self.blocks = nn.ModuleList(
            nn.ModuleList(StageBlock(args, s) for _ in range(args.depths[s])) for s in stages
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, blocks in zip(self.convs, self.blocks, strict=True):
            x = conv(x)
            for block in blocks:
                x = block(x)
        return x


class PositionEmbedding2D(nn.Module):
    """Learned column embeddings (the first half of a vector) and row embeddings."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, rows = args.embed_dim[-1], args.max_position_embeddings
        self.row_embeddings = nn.Embedding(rows, dim // 2)
        self.column_embeddings = nn.Embedding(rows, dim - dim // 2)

    def forward(self, height: int, width: int) -> torch.Tensor:
        """[h, w, C] for a grid of height x width."""
        device = self.row_embeddings.weight.device
        columns = self.column_embeddings(torch.arange(width, device=device))
        rows = self.row_embeddings(torch.arange(height, device=device))
        return torch.cat(
            [columns[None].expand(height, -1, -1), rows[:, None].expand(-1, width, -1)], dim=-1
        )


def temporal_position(dim: int) -> torch.Tensor:
    """The first row of Florence2VisionPositionalEmbeddingCosine1D's table [dim]: position 0's
    sines (0) at the even entries and cosines (1) at the odd ones."""
    out = torch.zeros(dim)
    out[1::2] = 1.0
    return out


class Projector(nn.Module):
    """Florence2MultiModalProjector: grid [B, C, h, w] -> [B, 1 + h*w, projection_dim]."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.embed_dim[-1]
        self.image_projection = nn.Linear(dim, args.projection_dim, bias=False)
        self.image_proj_norm = nn.LayerNorm(args.projection_dim)
        self.image_position_embed = PositionEmbedding2D(args)

    def forward(self, grid: torch.Tensor) -> torch.Tensor:
        b, c, h, w = grid.shape
        tokens = grid.permute(0, 2, 3, 1) + self.image_position_embed(h, w)
        # one frame: its temporal position is position 0's
        tokens = tokens.reshape(b, h * w, c) + temporal_position(c).to(grid)
        tokens = torch.cat([tokens.mean(dim=1, keepdim=True), tokens], dim=1)
        return self.image_proj_norm(self.image_projection(tokens))


class ImageEncoder(nn.Module):
    """The backbone and projector under Florence2Model's names (vision_tower.*,
    multi_modal_projector.*)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = Backbone(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image tokens [B, 1 + h*w, projection_dim] of pixels [B, 3, H, W]."""
        return self.multi_modal_projector(self.vision_tower(pixels))
