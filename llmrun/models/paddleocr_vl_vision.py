"""PaddleOCR-VL's vision tower and projector: an image's patches -> one token per 2x2
patches, in the language model's width.

A NaViT-style SigLIP: each patch_size² patch through a Conv2d, plus the learned square
table of position embeddings resized bilinearly to the image's grid of patches; blocks of
attention over the whole image with a 2D RoPE (a quarter of each head's features turned
by the patch's row, a quarter by its column, rotate_half's layout), a tanh-GELU MLP; a
final LayerNorm. The projector (the Hub's mlp_AR) normalizes each patch, concatenates each
2x2 group and projects it through an (exact) GELU MLP.

The patches come row by row, as PaddleOCRVLImageProcessor flattens them
(llmrun.paddleocr_vl_images); the tokens come out row by row of 2x2 groups.

Reference: transformers/models/paddleocr_vl/modeling_paddleocr_vl.py (PaddleOCRVisionModel,
PaddleOCRVisionEmbeddings, PaddleOCRVisionRotaryEmbedding, PaddleOCRProjector).
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

PROJECTOR_EPS = 1e-5  # PaddleOCRProjector's pre_norm


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    out_hidden_size: int  # the language model's width
    num_positions: int  # rows of the learned (square) position table
    patch_size: int = 14
    spatial_merge_size: int = 2
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads "
                "of a multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter "
                "by columns)"
            )
        if math.isqrt(self.num_positions) ** 2 != self.num_positions:
            raise ModelFormatError(
                f"{self.num_positions} learned vision positions are no square grid"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden: int) -> EncoderArgs:
        """From a PaddleOCRVLForConditionalGeneration's config.json dict."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("a PaddleOCR-VL config.json without a vision_config")
        rope = vision.get("rope_parameters") or {}
        image_size = vision.get("image_size", 384)
        patch_size = vision.get("patch_size", 14)
        try:
            return cls(
                hidden_size=vision.get("hidden_size", 1152),
                intermediate_size=vision.get("intermediate_size", 4304),
                num_hidden_layers=vision.get("num_hidden_layers", 27),
                num_attention_heads=vision.get("num_attention_heads", 16),
                out_hidden_size=text_hidden,
                num_positions=(image_size // patch_size) ** 2,
                patch_size=patch_size,
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                num_channels=vision.get("num_channels", 3),
                layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                rope_theta=rope.get("rope_theta", 10000.0),
            )
        except TypeError as e:
            raise ModelFormatError(f"a PaddleOCR-VL vision_config with bad sizes ({e})") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def temporal_patch_size(self) -> int:
        """A patch's frames: one (PaddleOCRVLImageProcessor's temporal_patch_size)."""
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
        side = math.isqrt(a.num_positions)
        # The table as a [1, hidden, side, side] image, resized to the grid of patches.
        table = self.position_embedding.weight.float().T.reshape(1, -1, side, side)
        resized = F.interpolate(table, (grid_h, grid_w), mode="bilinear", align_corners=False)
        return x + resized[0].flatten(1).T.to(x.dtype)


def rotary_angles(args: EncoderArgs, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of the 2D RoPE, patches row by row: the first
    quarter of the features turned by the patch's row, the second by its column, the
    second half repeating the first."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w).flatten()
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w).flatten()
    quarter = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        return self.out_proj(attend_rotated(x, self.heads, projections, cos, sin))


def attend_rotated(
    x: torch.Tensor,
    heads: int,
    projections: tuple[nn.Module, nn.Module, nn.Module],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The whole image attending to itself: x [N, dim] through the q, k and v
    `projections` into `heads` heads, q and k turned by cos/sin [N, head_dim]; the heads'
    outputs [N, dim], before the output projection."""
    n, dim = x.shape
    # [N, dim] -> [N, heads, head_dim]
    q, k, v = (proj(x).view(n, heads, -1) for proj in projections)
    q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
    # [N, heads, head_dim] -> [1, heads, N, head_dim]: the whole image attends to itself
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
    return out[0].transpose(0, 1).reshape(n, dim)


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.approximate = "tanh" if args.hidden_act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = Attention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class Projector(nn.Module):
    """The Hub's mlp_AR: LayerNorm, each 2x2 group concatenated, Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.merge = args.spatial_merge_size
        merged = args.hidden_size * self.merge**2
        self.pre_norm = nn.LayerNorm(args.hidden_size, eps=PROJECTOR_EPS)
        self.linear_1 = nn.Linear(merged, merged)
        self.linear_2 = nn.Linear(merged, args.out_hidden_size)

    def forward(self, x: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        groups = merged_groups(self.pre_norm(x), grid_h, grid_w, self.merge)
        return self.linear_2(F.gelu(self.linear_1(groups)))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * P * P] (row by row) -> tokens [grid_h/2 * grid_w/2,
    out_hidden_size] (2x2 groups row by row)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        check_patches(
            patches, grid_h, grid_w, self.args.patch_features, self.args.spatial_merge_size
        )
        x = self.embeddings(patches, grid_h, grid_w)
        cos, sin = rotary_angles(self.args, grid_h, grid_w)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        return self.projector(self.post_layernorm(x), grid_h, grid_w)


def merged_groups(x: torch.Tensor, grid_h: int, grid_w: int, m: int) -> torch.Tensor:
    """Patches x [grid_h * grid_w, d] (row by row) as their m x m groups [groups, m * m * d]
    (row by row, each group's patches row by row)."""
    # [h * w, d] -> [h/m, m, w/m, m, d] -> [h/m, w/m, m, m, d]: each group's patches together
    groups = x.view(grid_h // m, m, grid_w // m, m, -1).transpose(1, 2)
    return groups.reshape((grid_h // m) * (grid_w // m), -1)


def check_patches(
    patches: torch.Tensor, grid_h: int, grid_w: int, features: int, merge: int
) -> None:
    """Refuses patches that are not [grid_h * grid_w, features] in whole merge x merge
    groups."""
    if patches.shape != (grid_h * grid_w, features) or grid_h % merge or grid_w % merge:
        raise ValueError(
            f"patches {tuple(patches.shape)} are not a {grid_h}x{grid_w} grid of "
            f"{features} values in {merge}x{merge} groups"
        )
