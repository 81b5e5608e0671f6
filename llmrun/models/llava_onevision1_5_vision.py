"""LLaVA-OneVision-1.5's vision tower (RICE-ViT): an image's patches -> one token per 2x2
patches, in the language model's width.

Qwen2-VL's tower (llmrun.models.qwen2_vl_vision: its 2D RoPE, fused-qkv attention over the
whole image, GELU fc1/fc2 MLP) with these differences: each patch is one frame through a
Conv2d without bias; a learned class token goes first, turned by its own learned angles;
a LayerNorm before the blocks; LayerNorms of layer_norm_eps; the class token is dropped
after the blocks, and the merger normalizes each patch, concatenates each 2x2 group and
projects it through Linear-GELU-Linear.

The patches come in the order Qwen2VLImageProcessor flattens them (temporal_patch_size 1):
2x2 groups row by row, the 4 patches of a group together (llmrun.qwen2_vl_images).

Reference: transformers/models/llava_onevision1_5/modeling_llava_onevision1_5.py
(LlavaOnevision15VisionModel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models import qwen2_vl_vision
from llmrun.models.qwen2_vl_vision import MLP, Attention, rotary_angles


@dataclass
class EncoderArgs(qwen2_vl_vision.EncoderArgs):
    """Qwen2-VL's (family qwen2_vl, every block global) with the norms' epsilon."""

    layer_norm_eps: float = 1e-5


class PatchEmbed(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        kernel = (args.patch_size, args.patch_size)
        self.proj = nn.Conv2d(args.in_channels, args.hidden_size, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        a = self.args
        # [N, C*P*P] -> [N, C, P, P] -> [N, hidden]
        return self.proj(patches.view(-1, a.in_channels, a.patch_size, a.patch_size)).view(
            -1, a.hidden_size
        )


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, [len(x)])
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 group's normalized patches, concatenated, through Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, args.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * P * P] of one image -> merged tokens
    [grid_h/m * grid_w/m, out_hidden_size] row by row, with the checkpoints' names
    (visual.*, as the Hub's files and save_pretrained write them)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.class_embedding = nn.Parameter(torch.empty(args.hidden_size))
        self.class_pos_emb = nn.Parameter(torch.empty(1, args.head_dim // 2))
        self.pre_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = torch.cat([self.class_embedding[None], self.patch_embed(patches)])
        cos, sin = rotary_angles(self.args, grid_h, grid_w)
        class_angles = torch.cat([self.class_pos_emb, self.class_pos_emb], dim=-1)
        cos = torch.cat([class_angles.cos(), cos])
        sin = torch.cat([class_angles.sin(), sin])
        x = self.pre_layernorm(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x[1:])
