"""Muse Glimmer's vision tower and projector: an image's patches -> one token per
merge_size² patches, in the language model's width.

A ViT over patch_size² patches (the two temporal slabs of transformers' patch embedding
summed: an image repeats its one frame in both), plus the learned square table of
position embeddings resampled bilinearly (zero padding) to the image's grid, read with
the grid's height and width swapped as the reference does; LayerNorm; blocks that attend
within square windows of pos_emb_height patches (every fourth block and the last over
the whole image, as layer_types lists them) with an axial 2D RoPE (the first quarter of a
head turned by the patch's column + 1, the second by its row + 1, the halves repeated,
rotate_half's layout) and an exact-GELU MLP; LayerNorm; each merge_size² block of patches
folded into the channels (channel-major); the adapter (two linears, GELU after each), the
projection to the text's width and a weightless RMSNorm.

The patches come row by row (llmrun.muse_glimmer_images); the tokens come out row by row
of merged blocks.

Reference: transformers/models/muse_glimmer/modeling_muse_glimmer.py
(MuseGlimmerVisionModel, MuseGlimmerVisionAdapter, MuseGlimmerModel.get_image_features)
and transformers/vision_utils.py (window index, interpolation weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.vision_rope import rotate

LAYER_KINDS = ("window_attention", "full_attention")


def default_layer_types(layers: int) -> list[str]:
    """MuseGlimmerVisionConfig's: every fourth layer and the last over the whole image."""
    return [
        "full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "window_attention"
        for i in range(layers)
    ]


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    projector_hidden_size: int
    out_hidden_size: int  # the language model's width
    pos_emb_side: int  # the learned position table is pos_emb_side x pos_emb_side
    patch_size: int = 14
    merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # the weightless RMSNorm last (the text's rms_norm_eps)
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_KINDS
        ):
            raise ModelFormatError(
                f"vision layer_types {self.layer_types!r}: not one of {', '.join(LAYER_KINDS)} "
                f"for each of the {self.num_hidden_layers} layers"
            )
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads "
                "of a multiple of 4 features (the 2D RoPE turns a quarter by columns, a quarter "
                "by rows)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a MuseGlimmerForConditionalGeneration's config.json dict (its vision_config
        and text_config, MuseGlimmerConfig's defaults where they are left out)."""
        vision, text = config.get("vision_config"), config.get("text_config") or {}
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a Muse Glimmer config.json without a vision_config")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedError(
                f"Muse Glimmer's vision RoPE type {rope.get('rope_type')!r} (only axial is)"
            )
        for name, expected in (("hidden_act", "gelu"), ("projector_hidden_act", "gelu")):
            held = (vision if name == "hidden_act" else config).get(name, expected)
            if held != expected:
                raise UnsupportedError(f"Muse Glimmer's {name} {held!r} (only gelu is)")
        side = vision.get("pos_emb_height", 32)
        if vision.get("pos_emb_width", side) != side:
            raise UnsupportedError(
                "Muse Glimmer's vision position table is not square (transformers reads "
                "square ones only)"
            )
        hidden, merge = vision.get("hidden_size", 1536), vision.get("merge_size", 2)
        if config.get("out_hidden_size", hidden * merge * merge) != hidden * merge * merge:
            raise ModelFormatError(
                f"Muse Glimmer's out_hidden_size {config['out_hidden_size']} is not the vision "
                f"width {hidden} times merge_size² ({merge * merge})"
            )
        if vision.get("patch_temporal", 2) < 1:
            raise ModelFormatError("Muse Glimmer's patch_temporal is not a positive count")
        return cls(
            hidden_size=hidden,
            intermediate_size=vision.get("intermediate_size", 8960),
            num_hidden_layers=vision.get("num_hidden_layers", 50),
            num_attention_heads=vision.get("num_attention_heads", 16),
            projector_hidden_size=config.get("projector_hidden_size", 4096),
            out_hidden_size=text.get("hidden_size", 6656),
            pos_emb_side=side,
            patch_size=vision.get("patch_size", 14),
            merge_size=merge,
            layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", 10000.0),
            norm_eps=text.get("rms_norm_eps", 1e-5),
            layer_types=vision.get("layer_types") or [],
        )


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps into a `side`-long table axis for `index` on an axis of `size`
    (half-pixel centres), out-of-range taps weighted 0 (grid_sample's zero padding)."""
    src = (index.float() + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    raw = floor.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - raw.float()).abs()).clamp(min=0)
    weights = weights * ((raw >= 0) & (raw <= side - 1))
    return raw.clamp(0, side - 1), weights


def position_taps(side: int, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row by row) 4 taps into the flattened position table and their
    weights. The reference hands the grid over as (width, height): patch i is read as
    row i // grid_h of grid_w rows, column i % grid_h of grid_h columns."""
    index = torch.arange(grid_h * grid_w)
    row_taps, row_weights = _axis_taps(index // grid_h, grid_w, side)
    col_taps, col_weights = _axis_taps(index % grid_h, grid_h, side)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return taps, weights


def windows(grid_h: int, grid_w: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The patches' order grouped into side x side windows (windows row by row, patches row
    by row within one), and each window's patch count."""
    index = torch.arange(grid_h * grid_w).view(grid_h, grid_w)
    order, sizes = [], []
    for top in range(0, grid_h, side):
        for left in range(0, grid_w, side):
            block = index[top : top + side, left : left + side].flatten()
            order.append(block)
            sizes.append(block.numel())
    return torch.cat(order), sizes


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        # [N, D] -> [H, N, head_dim]
        q, k, v = (
            p(x).view(tokens, self.heads, self.head_dim).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out, start = [], 0
        for span in spans:  # each window (or the whole image) attends within itself
            part = slice(start, start + span)
            out.append(F.scaled_dot_product_attention(q[:, part], k[:, part], v[:, part]))
            start += span
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-5)  # fixed in the reference
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-5)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchEmbedder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.side = args.pos_emb_side
        self.patch_embedding = nn.Linear(3 * args.patch_size**2, args.hidden_size, bias=False)
        self.position_embedding_table = nn.Embedding(self.side**2, args.hidden_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        taps, weights = position_taps(self.side, grid_h, grid_w)
        positions = (self.position_embedding_table(taps) * weights[:, :, None]).sum(1)
        return self.patch_embedding(patches) + positions


class Adapter(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.hidden_size * args.merge_size**2
        self.fc1 = nn.Linear(width, args.projector_hidden_size, bias=False)
        self.fc2 = nn.Linear(args.projector_hidden_size, args.projector_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class VisionModel(nn.Module):
    """patches [grid_h * grid_w, 3 * patch_size²] (row by row) -> tokens
    [grid_h * grid_w / merge_size², out_hidden_size] (row by row of merged blocks)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        dim = args.hidden_size
        self.patch_embedder = PatchEmbedder(args)
        self.ln_pre = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_hidden_layers))
        self.ln_post = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.vision_adapter = Adapter(args)
        self.vision_projection = nn.Linear(
            args.projector_hidden_size, args.out_hidden_size, bias=False
        )

    def rope(self, order: torch.Tensor, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] of the patches in `order`: a quarter of the features
        by column + 1, a quarter by row + 1, repeated for rotate_half's other half."""
        quarter = self.args.head_dim // 4
        inv_freq = 1.0 / (
            self.args.rope_theta
            ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter))
        )
        columns, rows = order % grid_w + 1, order // grid_w + 1
        angles = torch.cat((columns[:, None] * inv_freq, rows[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        args, merge = self.args, self.args.merge_size
        if grid_h % merge or grid_w % merge:
            raise ModelFormatError(
                f"a grid of {grid_h} x {grid_w} patches does not merge in blocks of {merge}"
            )
        x = self.ln_pre(self.patch_embedder(patches, grid_h, grid_w))
        order, window_sizes = windows(grid_h, grid_w, args.pos_emb_side)
        x = x[order]
        cos, sin = self.rope(order, grid_w)
        whole = [grid_h * grid_w]
        for layer, kind in zip(self.layers, args.layer_types, strict=True):
            x = layer(x, cos, sin, window_sizes if kind == "window_attention" else whole)
        x = self.ln_post(x[torch.argsort(order)])
        # [h, w, D] -> [h/m, w/m, m*m, D] -> [tokens, D * m*m], each channel's m*m together
        blocks = x.view(grid_h // merge, merge, grid_w // merge, merge, -1).permute(0, 2, 4, 1, 3)
        x = blocks.reshape(-1, x.shape[-1] * merge * merge)
        x = self.vision_projection(self.vision_adapter(x))
        return F.rms_norm(x.float(), (x.shape[-1],), eps=args.norm_eps).type_as(x)


def check_square(count: int) -> int:
    """The side of a square position table of `count` rows."""
    side = math.isqrt(count)
    if side * side != count:
        raise ModelFormatError(f"{count} learned vision positions are no square grid")
    return side
