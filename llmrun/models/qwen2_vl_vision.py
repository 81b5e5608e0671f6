"""Qwen2-VL's and Qwen2.5-VL's vision tower: an image's patches -> one token per 2x2
patches, in the language model's width.

Each patch is temporal_patch_size frames (a still image repeated) of patch_size² pixels
through a Conv3d; blocks of attention with a 2D RoPE (half of each head's pairs turned
by the patch's row, half by its column), then a merger that normalizes the patches,
concatenates each 2x2 group and projects it through a GELU MLP. Qwen2-VL: LayerNorm and
a QuickGELU MLP, every block attending to the whole image. Qwen2.5-VL: RMSNorm and a
SwiGLU MLP, blocks attending within windows of window_size pixels but for the
fullatt_block_indexes ones; the patches are reordered window by window for the blocks
and the merged tokens put back in order after. EXAONE 4.5's tower is Qwen2.5-VL's with
fewer key and value heads than query heads (num_key_value_heads, grouped-query
attention; its axial 2D RoPE is the same turning).

The patches come in the order Qwen2VLImageProcessor flattens them: 2x2 groups row by row,
the 4 patches of a group together (llmrun.qwen2_vl_images).

Reference: transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py
(Qwen2_5_VisionTransformerPretrainedModel), models/qwen2_vl/modeling_qwen2_vl.py
(Qwen2VisionTransformerPretrainedModel), vision_utils.py (get_vision_window_index),
models/exaone4_5/modeling_exaone4_5.py (Exaone4_5_VisionAttention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm
from llmrun.models.vision_rope import rotate_heads

# The families (config model_type), and what their blocks are made of.
QWEN2_VL, QWEN2_5_VL = "qwen2_vl", "qwen2_5_vl"
EXAONE4_5 = "exaone4_5"  # a config of Qwen2.5-VL's blocks with num_key_value_heads
EPS = 1e-6  # both families' vision norms


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"silu": F.silu, "quick_gelu": _quick_gelu, "gelu": F.gelu}


@dataclass
class EncoderArgs:
    family: str  # QWEN2_VL or QWEN2_5_VL
    hidden_size: int  # the blocks' width
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int  # the language model's width
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112  # Qwen2.5-VL's, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    num_key_value_heads: int | None = None  # EXAONE 4.5's; None: num_heads

    def __post_init__(self) -> None:
        if self.family not in (QWEN2_VL, QWEN2_5_VL):
            raise UnsupportedError(f"vision family {self.family!r} is not Qwen2-VL's")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_heads
        if self.num_key_value_heads < 1 or self.num_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"vision num_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_heads} heads of a "
                "multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter by columns)"
            )
        unit = self.patch_size * self.spatial_merge_size
        if self.family == QWEN2_5_VL and (self.window_size < unit or self.window_size % unit):
            raise ModelFormatError(
                f"vision window_size {self.window_size} is not a multiple of {unit} pixels"
            )
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ModelFormatError(
                f"fullatt_block_indexes {list(self.fullatt_block_indexes)} are not blocks of "
                f"the {self.depth}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Qwen2VLForConditionalGeneration's, Qwen2_5_VLForConditionalGeneration's or
        Exaone4_5_ForConditionalGeneration's config.json dict."""
        family = config.get("model_type")
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError(f"a {family} config.json without a vision_config")
        try:
            rope = vision.get("rope_parameters") or {}
            common = dict(
                family=QWEN2_5_VL if family == EXAONE4_5 else family,
                depth=vision["depth"],
                num_heads=vision["num_heads"],
                patch_size=vision.get("patch_size", 14),
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                in_channels=vision.get("in_channels", 3),
                rope_theta=rope.get("rope_theta", 10000.0),
            )
            if family == QWEN2_VL:
                # Qwen2VLVisionConfig: embed_dim is the blocks' width, hidden_size the output's.
                width = vision.get("embed_dim", 1280)
                return cls(
                    hidden_size=width,
                    intermediate_size=int(width * vision.get("mlp_ratio", 4)),
                    out_hidden_size=vision.get("hidden_size", 3584),
                    hidden_act=vision.get("hidden_act", "quick_gelu"),
                    fullatt_block_indexes=tuple(range(vision["depth"])),
                    **common,
                )
            return cls(
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                out_hidden_size=vision["out_hidden_size"],
                hidden_act=vision.get("hidden_act", "silu"),
                window_size=vision.get("window_size", 112),
                fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                # Exaone4_5_VisionConfig's default
                num_key_value_heads=vision.get("num_key_value_heads", 8)
                if family == EXAONE4_5
                else None,
                **common,
            )
        except KeyError as e:
            raise ModelFormatError(f"a {family} vision_config without {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """The values of one flattened patch: channels x frames x patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _norm(args: EncoderArgs, dim: int) -> nn.Module:
    return RMSNorm(dim, EPS) if args.family == QWEN2_5_VL else nn.LayerNorm(dim, eps=EPS)


class PatchEmbed(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        a = self.args
        # [N, C*T*P*P] -> [N, C, T, P, P] -> [N, hidden]
        frames = patches.view(-1, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        return self.proj(frames).view(-1, a.hidden_size)


def rotary_angles(args: EncoderArgs, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of the 2D RoPE, patches in the processor's order:
    the first quarter of the features turned by the patch's row, the second by its column,
    the second half repeating the first (rotate_half's layout)."""
    merge = args.spatial_merge_size
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    # [h, w] -> [h/m, m, w/m, m] -> 2x2 groups row by row, each group's patches together
    order = (grid_h // merge, merge, grid_w // merge, merge)
    rows = rows.reshape(order).transpose(1, 2).flatten()
    cols = cols.reshape(order).transpose(1, 2).flatten()
    quarter = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads = args.num_heads, args.num_key_value_heads
        kv_width = self.kv_heads * args.head_dim
        self.qkv = nn.Linear(args.hidden_size, args.hidden_size + 2 * kv_width)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        n, dim = x.shape
        # [N, (heads + 2*kv_heads) * head_dim] -> [N, heads, head_dim], 2 x [N, kv_heads, ...]
        qkv = self.qkv(x).view(n, self.heads + 2 * self.kv_heads, -1)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        if self.kv_heads != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        out = []
        # Each segment (the whole image, or one window) attends to itself only.
        for qs, ks, vs in zip(*(t.split(segments) for t in (q, k, v)), strict=True):
            # [n, heads, head_dim] -> [1, heads, n, head_dim]
            a = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)))
            out.append(a[0].transpose(0, 1).reshape(-1, dim))
        return self.proj(torch.cat(out))


class MLP(nn.Module):
    """Qwen2.5-VL's SwiGLU (gate, up, down) or Qwen2-VL's two layers (fc1, fc2), with biases."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[args.hidden_act]
        dim, inner = args.hidden_size, args.intermediate_size
        self.gated = args.family == QWEN2_5_VL
        if self.gated:
            self.gate_proj = nn.Linear(dim, inner)
            self.up_proj = nn.Linear(dim, inner)
            self.down_proj = nn.Linear(inner, dim)
        else:
            self.fc1 = nn.Linear(dim, inner)
            self.fc2 = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = _norm(args, args.hidden_size)
        self.norm2 = _norm(args, args.hidden_size)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 group's normalized patches, concatenated, through Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = _norm(args, args.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, args.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def window_order(args: EncoderArgs, grid_h: int, grid_w: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over an image's merged tokens [grid_h/m, grid_w/m]: the merged
    tokens' indexes window by window (each window's row by row, the windows row by row,
    those at the right and bottom edges smaller), and each window's count of patches."""
    merge = args.spatial_merge_size
    side = args.window_size // args.patch_size // merge  # merged tokens a window spans
    rows, cols = grid_h // merge, grid_w // merge
    index = torch.arange(rows * cols).view(rows, cols)
    order, sizes = [], []
    for top in range(0, rows, side):
        for left in range(0, cols, side):
            window = index[top : top + side, left : left + side].flatten()
            order.append(window)
            sizes.append(len(window) * merge * merge)
    return torch.cat(order), sizes


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, patch_features] of one image -> merged tokens
    [grid_h/m * grid_w/m, out_hidden_size] row by row, with HF's module names (visual.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        args = self.args
        unit = args.spatial_merge_size**2
        x = self.patch_embed(patches)
        cos, sin = rotary_angles(args, grid_h, grid_w)
        whole = [len(x)]
        windows = whole
        order = None
        if args.family == QWEN2_5_VL:
            order, windows = window_order(args, grid_h, grid_w)

            def by_window(t: torch.Tensor) -> torch.Tensor:
                # [N, ...] -> [N/unit, unit, ...] reordered by merged token -> [N, ...]
                return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

            x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in args.fullatt_block_indexes else windows)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged
