"""HunYuan-VL's (HunyuanOCR's) vision tower and projector: an image's patches -> its
tokens in the language model's width, one per 2x2 patches plus one closing each row, and a
learned begin and end token around them.

A NaViT-style ViT: each patch_size² patch through a Conv2d, plus the learned square table
of position embeddings (its first row, a class token's, unused) resized bilinearly to the
image's grid of patches; pre-LayerNorm blocks of attention over the whole image (no RoPE)
and an (exact) GELU MLP. The projector (Tencent's `perceive`) RMS-normalizes each patch,
merges each 2x2 group with a strided Conv2d, GELU, a 1x1 Conv2d, appends the learned
newline after each row of groups, projects every token with a Linear, puts the learned
begin and end tokens around them and RMS-normalizes them all.

The patches come row by row, as HunYuanVLImageProcessor flattens them
(llmrun.hunyuan_vl_images); the tokens come out row by row.

Reference: transformers/models/hunyuan_vl/modeling_hunyuan_vl.py
(HunYuanVLVisionTransformer, HunYuanVLVisionPatchEmbed, HunYuanVLVisionPatchMerger).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    out_hidden_size: int  # the language model's width
    num_positions: int  # rows of the learned position table: a square grid and one more
    patch_size: int = 16
    spatial_merge_size: int = 2
    num_channels: int = 3
    rms_norm_eps: float = 1e-5  # its LayerNorms' and RMSNorms' eps alike
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_act != "gelu":
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        side = math.isqrt(max(self.num_positions - 1, 0))
        if side * side != self.num_positions - 1 or side == 0:
            raise ModelFormatError(
                f"{self.num_positions} learned vision positions are no square grid and a "
                "class token's"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden: int) -> EncoderArgs:
        """From a HunYuanVLForConditionalGeneration's config.json dict."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("a HunYuan-VL config.json without a vision_config")
        patch_size = vision.get("patch_size", 16)
        try:
            side = vision.get("max_image_size", 2048) // patch_size
            return cls(
                hidden_size=vision.get("hidden_size", 1152),
                intermediate_size=vision.get("intermediate_size", 4304),
                num_hidden_layers=vision.get("num_hidden_layers", 27),
                num_attention_heads=vision.get("num_attention_heads", 16),
                out_hidden_size=text_hidden,
                num_positions=side * side + 1,
                patch_size=patch_size,
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                num_channels=vision.get("num_channels", 3),
                rms_norm_eps=vision.get("rms_norm_eps", 1e-5),
                hidden_act=vision.get("hidden_act", "gelu"),
            )
        except TypeError as e:
            raise ModelFormatError(f"a HunYuan-VL vision_config with bad sizes ({e})") from None

    @property
    def temporal_patch_size(self) -> int:
        """A patch's frames: one (HunYuanVLImageProcessor's temporal_patch_size)."""
        return 1

    @property
    def patch_features(self) -> int:
        """The values of one flattened patch: channels x patch_size²."""
        return self.num_channels * self.patch_size**2


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        p = args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, p, p)
        self.position_embedding = nn.Embedding(args.num_positions, args.hidden_size)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        a = self.args
        # [N, C*P*P] -> [N, C, P, P] -> [N, hidden]
        pixels = patches.view(-1, a.num_channels, a.patch_size, a.patch_size)
        x = self.patch_embedding(pixels).view(-1, a.hidden_size)
        side = math.isqrt(a.num_positions - 1)
        # The table past the class token's row as a [1, hidden, side, side] image, resized.
        table = self.position_embedding.weight[1:].float().T.reshape(1, -1, side, side)
        resized = F.interpolate(table, (grid_h, grid_w), mode="bilinear", align_corners=False)
        return x + resized[0].flatten(1).T.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        # [N, dim] -> [1, heads, N, head_dim]: the whole image attends to itself
        q, k, v = (
            proj(x).view(n, self.heads, -1).transpose(0, 1)[None]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, dim))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, args.intermediate_size)
        self.dense_4h_to_h = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class PatchMerger(nn.Module):
    """Tencent's `perceive`: 2x2 groups through two convolutions, a newline after each
    row, a Linear to the language model's width, begin and end tokens, an RMSNorm."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim, m, out = args.hidden_size, args.spatial_merge_size, args.out_hidden_size
        self.before_rms = RMSNorm(dim, args.rms_norm_eps)
        self.proj_conv = nn.Conv2d(dim, dim * 2, m, m)
        self.proj_out = nn.Conv2d(dim * 2, dim * 4, 1)
        self.mlp = nn.Linear(dim * 4, out)
        self.image_newline = nn.Parameter(torch.empty(dim * 4))
        self.image_begin = nn.Parameter(torch.empty(out))
        self.image_end = nn.Parameter(torch.empty(out))
        self.after_rms = RMSNorm(out, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        # [h * w, d] -> [1, d, h, w] -> [1, 4d, h/m, w/m]
        x = self.before_rms(x).T.reshape(1, -1, grid_h, grid_w)
        x = self.proj_out(F.gelu(self.proj_conv(x)))
        _, channels, rows, columns = x.shape
        newline = self.image_newline.view(1, channels, 1, 1).expand(1, channels, rows, 1)
        # [1, 4d, rows, columns + 1] -> [rows * (columns + 1), 4d]
        x = torch.cat([x, newline.to(x.dtype)], dim=-1).flatten(2)[0].T
        x = self.mlp(x)
        x = torch.cat([self.image_begin[None].to(x.dtype), x, self.image_end[None].to(x.dtype)])
        return self.after_rms(x)


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * P * P] (row by row) -> tokens [1 + grid_h/2 *
    (grid_w/2 + 1) + 1, out_hidden_size] (begin, rows of groups each with its newline, end)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.perceive = PatchMerger(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        m = self.args.spatial_merge_size
        if patches.shape != (grid_h * grid_w, self.args.patch_features) or grid_h % m or grid_w % m:
            raise ValueError(
                f"patches {tuple(patches.shape)} are not a {grid_h}x{grid_w} grid of "
                f"{self.args.patch_features} values in {m}x{m} groups"
            )
        x = self.embeddings(patches, grid_h, grid_w)
        for layer in self.layers:
            x = layer(x)
        return self.perceive(x, grid_h, grid_w)
