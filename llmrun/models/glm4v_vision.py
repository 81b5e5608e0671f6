"""GLM-4.1V's and GLM-4.5V's vision tower: an image's patches -> one token per 2x2
patches, in the language model's width.

Each patch is temporal_patch_size frames (a still image repeated) of patch_size² pixels
through a Conv3d (with a bias), an RMSNorm, plus a learned position embedding: a square
grid resampled bicubically to the image's grid of patches (grid_sample at each patch's
centre, the border repeated). Blocks of RMSNorm, attention over the whole image with
Qwen2-VL's 2D RoPE (a quarter of each head's features turned by the patch's row, a
quarter by its column) and a SwiGLU MLP out_hidden_size wide; then a final RMSNorm, a
2x2 strided Conv2d that merges each group of patches into the language model's width,
and a merger: Linear, LayerNorm, GELU, SwiGLU.

GLM-OCR's tower (glm_ocr) is the same without the post-conv RMSNorm and the learned
positions: its attention normalizes each head's q and k (RMSNorm) before the RoPE and has
a bias on its output too, its blocks' MLP is intermediate_size wide with biases, and its
merger's SwiGLU is 3 * out_hidden_size wide (out_hidden_size * in_channels, as HF's).

The patches come in the order Qwen2VLImageProcessor (and Glm4vImageProcessor) flattens
them: 2x2 groups row by row, the 4 patches of a group together (llmrun.glm4v_images).

Reference: transformers/models/glm4v/modeling_glm4v.py (Glm4vVisionModel),
models/glm_ocr/modular_glm_ocr.py (GlmOcrVisionModel).
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
from llmrun.models.qwen2_vl_vision import rotary_angles
from llmrun.models.vision_rope import rotate_heads

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
MERGER_EPS = 1e-5  # the merger's LayerNorm (nn.LayerNorm's default)


@dataclass
class EncoderArgs:
    hidden_size: int  # the blocks' width
    intermediate_size: int  # the merger's SwiGLU (the blocks' is out_hidden_size wide)
    depth: int
    num_heads: int
    out_hidden_size: int  # the language model's width
    num_position_embeddings: int
    hidden_act: str = "silu"
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    glm_ocr: bool = False  # GLM-OCR's tower (the module docstring)

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise UnsupportedError(f"vision activation {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_heads} heads of a "
                "multiple of 4 features (the 2D RoPE turns a quarter by rows, a quarter by columns)"
            )
        side = math.isqrt(self.num_position_embeddings)
        if not self.glm_ocr and (side < 1 or side * side != self.num_position_embeddings):
            raise ModelFormatError(
                f"vision num_position_embeddings {self.num_position_embeddings} is not a "
                "square grid"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Glm4vForConditionalGeneration's (or Glm4vMoe's, GlmOcr's) config.json
        dict."""
        family = config.get("model_type")
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError(f"a {family} config.json without a vision_config")
        rope = vision.get("rope_parameters") or {}
        glm_ocr = family == "glm_ocr"
        try:
            patch = vision.get("patch_size", 14)
            return cls(
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                depth=vision["depth"],
                num_heads=vision["num_heads"],
                out_hidden_size=vision["out_hidden_size"],
                num_position_embeddings=(vision.get("image_size", 336) // patch) ** 2,
                hidden_act=vision.get("hidden_act", "silu"),
                attention_bias=vision.get("attention_bias", glm_ocr),
                rms_norm_eps=vision.get("rms_norm_eps", 1e-5),
                patch_size=patch,
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                in_channels=vision.get("in_channels", 3),
                rope_theta=rope.get("rope_theta", 10000.0),
                glm_ocr=glm_ocr,
            )
        except KeyError as e:
            raise ModelFormatError(f"a {family} vision_config without {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def block_mlp_size(self) -> int:
        return self.intermediate_size if self.glm_ocr else self.out_hidden_size

    @property
    def merger_size(self) -> int:
        return self.out_hidden_size * self.in_channels if self.glm_ocr else self.intermediate_size


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


class Embeddings(nn.Module):
    """The learned position embeddings of a square grid, resampled to an image's."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.position_embedding = nn.Embedding(args.num_position_embeddings, args.hidden_size)

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h * grid_w, hidden] in the processor's order: the table sampled
        bicubically at each patch's centre, (i + 0.5) / n of the way along each side."""
        side = math.isqrt(self.args.num_position_embeddings)
        # [side², hidden] -> [1, hidden, side, side]
        table = self.position_embedding.weight.view(side, side, -1).permute(2, 0, 1)[None]
        merge = self.args.spatial_merge_size
        rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
        cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
        # [h, w] -> [h/m, m, w/m, m] -> 2x2 groups row by row, each group's patches together
        order = (grid_h // merge, merge, grid_w // merge, merge)
        rows = rows.reshape(order).transpose(1, 2).flatten()
        cols = cols.reshape(order).transpose(1, 2).flatten()
        x = (cols.float() + 0.5) / grid_w * 2 - 1
        y = (rows.float() + 0.5) / grid_h * 2 - 1
        # grid [1, N, 1, (x, y)] -> sampled [1, hidden, N, 1]
        grid = torch.stack([x, y], dim=-1)[None, :, None].to(table.dtype)
        sampled = F.grid_sample(
            table, grid, mode="bicubic", align_corners=False, padding_mode="border"
        )
        return sampled[0, :, :, 0].T


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=args.attention_bias)
        proj_bias = args.glm_ocr and args.attention_bias
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=proj_bias)
        self.qk_norm = args.glm_ocr
        if self.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        # [N, 3*dim] -> 3 x [N, heads, head_dim]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)
        # [N, heads, head_dim] -> [1, heads, N, head_dim]: the whole image attends to itself
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return self.proj(out[0].transpose(0, 1).reshape(n, dim))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, inner: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[act]
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.norm2 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args)
        mlp_bias = args.glm_ocr and args.attention_bias
        self.mlp = MLP(args.hidden_size, args.block_mlp_size, args.hidden_act, mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Linear, LayerNorm, GELU, then a SwiGLU (its matrices under the merger's own names,
    as HF's): the merged tokens into the language model."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim, inner = args.out_hidden_size, args.merger_size
        self.act = _ACTIVATIONS[args.hidden_act]
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim, eps=MERGER_EPS)
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * frames * patch²] of one image -> merged tokens
    [grid_h/m * grid_w/m, out_hidden_size] row by row, with HF's module names (visual.*)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        if not args.glm_ocr:
            self.post_conv_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.embeddings = Embeddings(args)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.depth))
        self.post_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        merge = args.spatial_merge_size
        self.downsample = nn.Conv2d(args.hidden_size, args.out_hidden_size, merge, merge)
        self.merger = PatchMerger(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        args = self.args
        x = self.patch_embed(patches)
        if not args.glm_ocr:
            x = self.post_conv_layernorm(x)
            x = x + self.embeddings(grid_h, grid_w).to(x.dtype)
        cos, sin = rotary_angles(args, grid_h, grid_w)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.post_layernorm(x)
        merge = args.spatial_merge_size
        # [N, hidden] -> [N/m², hidden, m, m]: each 2x2 group a picture for the Conv2d
        groups = x.view(-1, merge, merge, args.hidden_size).permute(0, 3, 1, 2)
        return self.merger(self.downsample(groups).view(-1, args.out_hidden_size))
