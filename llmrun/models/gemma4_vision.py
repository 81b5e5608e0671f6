"""Gemma 4's image encoder: an image's patches -> soft tokens in the language model's
width. Each patch (its pixels scaled to [-1, 1]) projected, plus a learned embedding of
its column and one of its row; encoder layers with four norms each, q/k norms and
unscaled scores, values normalized without a scale, 2D RoPE (the first half of each head
turned by the patch's column, the second half by its row, NEOX-style within each half),
linears whose inputs and outputs may be clipped; the patch states average-pooled over
squares of pooling_kernel_size patches, times sqrt(hidden), maybe standardized by a
per-feature bias and scale; then RMS-normalized (no scale) and projected to the text
width.

One image per call, without padding: transformers pads every image to the processor's
patch budget and masks the padding out of the attention and the pooling, which leaves
the real patches' values as they are here.

Reference: transformers/models/gemma4/modeling_gemma4.py (Gemma4VisionModel,
Gemma4VisionPatchEmbedder, Gemma4VisionRotaryEmbedding, Gemma4VisionAttention,
Gemma4VisionEncoderLayer, Gemma4VisionPooler, Gemma4ClippableLinear,
Gemma4MultimodalEmbedder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.models.base import activation
from llmrun.models.gemma3n import RMSNorm


@dataclass
class VisionArgs:
    """Gemma4VisionConfig's fields llmrun uses, with its defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    rope_theta: float = 100.0

    def __post_init__(self) -> None:
        activation(self.hidden_activation)  # refused here when unknown
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"Gemma 4 vision: {self.num_attention_heads} heads over "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 4:
            raise ModelFormatError(
                f"Gemma 4 vision: head_dim {self.head_dim} does not split into two RoPE halves"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a Gemma4ForConditionalGeneration config.json's vision_config dict."""
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedError(
                f"Gemma 4 vision RoPE type {rope['rope_type']!r} is not supported (axial is)"
            )
        fields = {k: config[k] for k in cls.__dataclass_fields__ if config.get(k) is not None}
        fields["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        return cls(**fields)


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int


class ClippableLinear(nn.Module):
    """A linear without bias whose input and output are clamped to learned bounds where
    the config says (Gemma4ClippableLinear)."""

    def __init__(self, args: VisionArgs, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out, bias=False)
        self.clipped = args.use_clipped_linears
        if self.clipped:
            for name, bound in (("input_min", -1), ("input_max", 1), ("output_min", -1),
                                ("output_max", 1)):  # fmt: skip
                self.register_buffer(name, torch.tensor(bound * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


class PatchEmbedder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * args.patch_size**2, args.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.zeros(2, args.position_embedding_size, args.hidden_size)
        )

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [N, 3 * patch^2] in [0, 1], positions [N, 2] (column, row) -> [N, hidden]."""
        x = self.input_proj(2 * (patches - 0.5))
        table = self.position_embedding_table
        return x + table[0][positions[:, 0]] + table[1][positions[:, 1]]


def axial_rope(args: VisionArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] of patches at positions [N, 2] (column, row): each half of
    the head turned by one coordinate, the same head_dim / 4 frequencies for both."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    # [N, 2, head_dim / 4] -> each coordinate's angles twice (NEOX pairs i, i + half / 2)
    angles = positions.float()[:, :, None] * inv_freq
    angles = torch.cat([angles[:, 0], angles[:, 0], angles[:, 1], angles[:, 1]], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] turned by cos/sin [N, 1, head_dim], rotate-half within each
    coordinate's half of the head."""
    quarter = x.shape[-1] // 4
    a, b, c, d = x.split(quarter, dim=-1)
    rotated = torch.cat([-b, a, -d, c], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, heads, kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, args.head_dim
        self.q_proj = ClippableLinear(args, dim, heads * args.head_dim)
        self.k_proj = ClippableLinear(args, dim, kv_heads * args.head_dim)
        self.v_proj = ClippableLinear(args, dim, kv_heads * args.head_dim)
        self.o_proj = ClippableLinear(args, heads * args.head_dim, dim)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.v_norm = RMSNorm(args.head_dim, args.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        # [N, hidden] -> [N, heads, head_dim]
        q = _rotate_halves(self.q_norm(self.q_proj(x).view(n, self.heads, -1)), cos, sin)
        k = _rotate_halves(self.k_norm(self.k_proj(x).view(n, self.kv_heads, -1)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(n, self.kv_heads, -1))
        # [N, heads, head_dim] -> [heads, N, head_dim]; every patch sees every patch.
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, width = args.hidden_size, args.intermediate_size
        self.gate_proj = ClippableLinear(args, dim, width)
        self.up_proj = ClippableLinear(args, dim, width)
        self.down_proj = ClippableLinear(args, width, dim)
        self.act = activation(args.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class VisionModel(nn.Module):
    """Patches -> pooled, scaled (and standardized) features [tokens, vision hidden]."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embedder = PatchEmbedder(args)
        self.encoder = Encoder(args)
        if args.standardize:
            self.register_buffer("std_bias", torch.zeros(args.hidden_size))
            self.register_buffer("std_scale", torch.ones(args.hidden_size))

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """patches [N, 3 * patch^2] of an image whose N patches lie in a grid `positions`
        [N, 2] (column, row), row by row, both sides multiples of pooling_kernel_size."""
        args = self.args
        columns, rows = (int(positions[:, i].max()) + 1 for i in (0, 1))
        if max(columns, rows) > args.position_embedding_size:
            raise UsageError(
                f"an image of {columns}x{rows} patches is past the encoder's "
                f"{args.position_embedding_size} positions a side"
            )
        cos, sin = axial_rope(args, positions)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        x = self.patch_embedder(patches, positions)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = args.pooling_kernel_size
        # [rows * columns, hidden] -> [hidden, rows, columns] -> [tokens, hidden], row by row
        grid = x.float().T.reshape(1, -1, rows, columns)
        pooled = F.avg_pool2d(grid, k, k).flatten(2)[0].T
        pooled = pooled * args.hidden_size**0.5
        if args.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


class MultimodalEmbedder(nn.Module):
    """Soft tokens into the language model's width: RMS norm without a scale, then a
    projection (Gemma4MultimodalEmbedder)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        vision = args.vision
        self.embedding_pre_projection_norm = RMSNorm(
            vision.hidden_size, vision.rms_norm_eps, with_scale=False
        )
        self.embedding_projection = nn.Linear(vision.hidden_size, args.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class ImageEncoder(nn.Module):
    """An image's patches [N, 3 * patch^2] at positions [N, 2] -> soft tokens [N / k^2,
    text hidden], with HF's module names (vision_tower, embed_vision)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionModel(args.vision)
        self.embed_vision = MultimodalEmbedder(args)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_vision(self.vision_tower(patches, positions))
