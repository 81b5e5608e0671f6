"""Qwen3-VL's and Qwen3.5's vision tower: an image's patches -> one token per 2x2 patches,
in the language model's width, with Qwen3-VL's deepstack features beside each.

Each patch is temporal_patch_size frames (a still image repeated) of patch_size² pixels
through a Conv3d (with a bias), plus a learned position embedding: a square grid of
num_position_embeddings resampled bilinearly (corners aligned) to the image's grid of
patches. Blocks of LayerNorm, attention over the whole image with a 2D RoPE (a quarter of
each head's features turned by the patch's row, a quarter by its column) and a GELU MLP;
then a merger normalizes the patches, concatenates each 2x2 group and projects it through
Linear-GELU-Linear. Deepstack (Qwen3-VL; Qwen3.5 has none): after each block of
deepstack_visual_indexes, the patches go through a merger of their own (normalizing each
2x2 group after concatenating it), whose tokens the language model adds to its hidden
states at the image's tokens after its first decoder layers (llmrun.models.mrope).

The patches come in the order Qwen2VLImageProcessor flattens them: 2x2 groups row by row,
the 4 patches of a group together (llmrun.qwen2_vl_images).

Reference: transformers/models/qwen3_vl/modeling_qwen3_vl.py (Qwen3VLVisionModel),
models/qwen3_5/modeling_qwen3_5.py (Qwen3_5VisionModel), vision_utils.py
(get_vision_interpolation_indices_and_weights, get_vision_position_ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.vision_rope import rotate_heads

EPS = 1e-6  # the tower's LayerNorms
_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass
class EncoderArgs:
    hidden_size: int  # the blocks' width
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int  # the language model's width
    num_position_embeddings: int
    hidden_act: str = "gelu_pytorch_tanh"
    deepstack_visual_indexes: tuple[int, ...] = ()
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_heads} heads of a "
                "multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter by columns)"
            )
        side = math.isqrt(self.num_position_embeddings)
        if side < 2 or side * side != self.num_position_embeddings:
            raise ModelFormatError(
                f"vision num_position_embeddings {self.num_position_embeddings} is not a "
                "square grid"
            )
        indexes = self.deepstack_visual_indexes
        if any(not 0 <= i < self.depth for i in indexes) or len(set(indexes)) != len(indexes):
            raise ModelFormatError(
                f"deepstack_visual_indexes {list(indexes)} are not distinct blocks of the "
                f"{self.depth}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Qwen3-VL's (or Qwen3.5's) config.json dict."""
        family = config.get("model_type")
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError(f"a {family} config.json without a vision_config")
        rope = vision.get("rope_parameters") or {}
        try:
            return cls(
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                depth=vision["depth"],
                num_heads=vision["num_heads"],
                out_hidden_size=vision["out_hidden_size"],
                num_position_embeddings=vision.get("num_position_embeddings", 2304),
                hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes") or ()),
                patch_size=vision.get("patch_size", 16),
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                in_channels=vision.get("in_channels", 3),
                rope_theta=rope.get("rope_theta", 10000.0),
            )
        except KeyError as e:
            raise ModelFormatError(f"a {family} vision_config without {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class PatchEmbed(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel, kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        a = self.args
        # [N, C*T*P*P] -> [N, C, T, P, P] -> [N, hidden]
        frames = patches.view(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        return self.proj(frames).view(-1, a.hidden_size)


def _by_group(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] -> [h * w, ...] in the processor's order: 2x2 groups row by row, each
    group's patches together."""
    h, w = grid.shape[:2]
    grouped = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:])
    return grouped.transpose(1, 2).reshape(h * w, *grid.shape[2:])


def rotary_angles(args: EncoderArgs, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of the 2D RoPE, patches in the processor's order:
    the first quarter of the features turned by the patch's row, the second by its column,
    the second half repeating the first (rotate_half's layout)."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    rows, cols = (_by_group(t, args.spatial_merge_size) for t in (rows, cols))
    quarter = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        # [N, 3*dim] -> 3 x [N, heads, head_dim]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        # [N, heads, head_dim] -> [1, heads, N, head_dim]: the whole image attends to itself
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return self.proj(out[0].transpose(0, 1).reshape(n, dim))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[args.hidden_act]
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=EPS)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=EPS)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 group of patches normalized (each patch, or with `grouped` the group's
    concatenation: deepstack's), concatenated, through Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs, grouped: bool = False) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.grouped = grouped
        self.norm = nn.LayerNorm(self.width if grouped else args.hidden_size, eps=EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.grouped else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * frames * patch²] of one image -> merged tokens
    [grid_h/m * grid_w/m, out_hidden_size * (1 + deepstack)] row by row: each token's
    features, then its deepstack features of each deepstack block in order (the layout
    of llama.cpp's embeddings for Qwen3-VL). HF's module names (visual.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args, grouped=True) for _ in args.deepstack_visual_indexes
        )

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """The learned position embeddings [grid_h * grid_w, hidden] in the processor's
        order: the square grid resampled bilinearly, corners aligned."""
        side = math.isqrt(self.args.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(table, (grid_h, grid_w), mode="bilinear", align_corners=True)
        # [1, hidden, h, w] -> [h, w, hidden]
        return _by_group(resized[0].permute(1, 2, 0), self.args.spatial_merge_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        args = self.args
        x = self.patch_embed(patches) + self.positions(grid_h, grid_w)
        cos, sin = rotary_angles(args, grid_h, grid_w)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in args.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[args.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
