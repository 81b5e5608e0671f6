"""Kimi K2.5's vision tower (MoonViT) and projector: an image's patches -> one token per
2x2 patches, in the language model's width.

Each patch_size² patch through a Conv2d, plus the learned [H, W] table of position
embeddings resized bicubically to the image's grid of patches (an image is one frame: the
table of frames adds nothing); blocks of attention over the whole image with a 2D RoPE
(each head's pairs alternately turned by the patch's column and its row, rotate_half's
layout), a tanh-GELU MLP; a final LayerNorm. The projector normalizes each patch,
concatenates each 2x2 group and projects it through an (exact) GELU MLP.

The patches come row by row, as Kimi_K25ImageProcessor flattens them
(llmrun.kimi_k25_images); the tokens come out row by row of 2x2 groups.

Reference: transformers/models/kimi_k25/modeling_kimi_k25.py (Kimi_K25VisionModel,
Kimi_K25VisionPositionEmbeddings, Kimi_K25VisionRotaryEmbedding,
Kimi_K25MultimodalProjection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.paddleocr_vl_vision import MLP, attend_rotated, check_patches, merged_groups

LAYER_NORM_EPS = 1e-5  # Kimi_K25VisionEncoderLayer's and its final_layernorm's


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    out_hidden_size: int  # the language model's width
    pos_emb_height: int
    pos_emb_width: int
    patch_size: int = 14
    merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    projection_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads "
                "of a multiple of 4 features (the 2D RoPE turns pairs by columns and by rows)"
            )
        if self.pos_emb_height != self.pos_emb_width:
            # transformers resamples the table as a square of pos_emb_height per side.
            raise ModelFormatError(
                f"a {self.pos_emb_height}x{self.pos_emb_width} table of vision positions, "
                "not a square"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_features(self) -> int:
        """The values of one flattened patch: 3 channels x patch_size²."""
        return 3 * self.patch_size**2


class PositionEmbeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.position_embeddings = nn.Parameter(
            torch.empty(args.pos_emb_height, args.pos_emb_width, args.hidden_size)
        )

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """The table resized to the grid, [grid_h * grid_w, hidden] row by row."""
        # [H, W, hidden] -> [1, hidden, H, W], resized as F.interpolate's bicubic does (which
        # transformers' gather of 4x4 taps reproduces).
        table = self.position_embeddings.float().permute(2, 0, 1)[None]
        if table.shape[-2:] != (grid_h, grid_w):
            table = F.interpolate(table, (grid_h, grid_w), mode="bicubic", align_corners=False)
        return table[0].flatten(1).T


class PatchEmbed(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        p = args.patch_size
        self.proj = nn.Conv2d(3, args.hidden_size, p, p)
        self.pos_emb = PositionEmbeddings(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        p = self.args.patch_size
        # [N, 3*P*P] -> [N, 3, P, P] -> [N, hidden]
        x = self.proj(patches.view(-1, 3, p, p)).flatten(1)
        return x + self.pos_emb(grid_h, grid_w).to(x.dtype)


def rotary_angles(args: EncoderArgs, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of the 2D RoPE, patches row by row: pair 2i of the
    first half turned by the patch's column at frequency i, pair 2i + 1 by its row, the
    second half repeating the first (Kimi_K25VisionRotaryEmbedding)."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w).flatten().float()
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w).flatten().float()
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    # [N, head_dim / 4, (column, row)] -> [N, head_dim / 2]: column and row alternate
    freqs = torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1).flatten(1)
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
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        return self.proj(attend_rotated(x, self.heads, projections, cos, sin))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = Attention(args)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(args)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)


class Projector(nn.Module):
    """Kimi_K25MultimodalProjection: LayerNorm per patch, each 2x2 group concatenated,
    Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.merge = args.merge_size
        merged = args.hidden_size * self.merge**2
        self.pre_norm = nn.LayerNorm(args.hidden_size, eps=args.projection_eps)
        self.in_proj = nn.Linear(merged, merged)
        self.out_proj = nn.Linear(merged, args.out_hidden_size)

    def forward(self, x: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        groups = merged_groups(self.pre_norm(x), grid_h, grid_w, self.merge)
        return self.out_proj(F.gelu(self.in_proj(groups)))


class ImageEncoder(nn.Module):
    """Patches [grid_h * grid_w, 3 * P * P] (row by row) -> tokens [grid_h/2 * grid_w/2,
    out_hidden_size] (2x2 groups row by row)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.mm_projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        check_patches(patches, grid_h, grid_w, self.args.patch_features, self.args.merge_size)
        tower = self.vision_tower
        x = tower.patch_embed(patches, grid_h, grid_w)
        cos, sin = rotary_angles(self.args, grid_h, grid_w)
        for layer in tower.layers:
            x = layer(x, cos, sin)
        return self.mm_projector(tower.final_layernorm(x), grid_h, grid_w)
