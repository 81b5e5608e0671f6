"""LFM3-VL's vision tower and projector: an image's patches -> one language-model token
per 2x2 patches.

Each patch is temporal_patch_size frames (a still image repeated) of patch_size² pixels,
embedded by one Linear without a bias (the Hub's patchifier) and RMS-normed. Then LFM2's
layers over the patches: pre-norm, either a gated depthwise 2D convolution over the
image's grid of patches ("conv": in_proj gives an input gate, an output gate and the
convolution's input) or bidirectional grouped-query attention with RMS-normed query and
key heads and Qwen3-VL's 2D RoPE (a quarter of each head turned by the patch's row, a
quarter by its column), each followed by a SwiGLU. The projector LayerNorms each patch,
concatenates each 2x2 group and maps it through Linear-GELU-Linear.

The patches come in the order Qwen2VLImageProcessor flattens them: 2x2 groups row by row,
the 4 patches of a group together (llmrun.qwen2_vl_images); the convolution sees them on
their grid.

Reference: transformers/models/lfm3_vl/modeling_lfm3_vl.py (Lfm3VlVisionModel,
Lfm3VlMultiModalProjector). Parameter names are the Hub's checkpoint keys (transformers
renames patchifier, q_layernorm and k_layernorm in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm
from llmrun.models.qwen3_vl_vision import rotary_angles
from llmrun.models.vision_rope import rotate_heads

CONV, ATTENTION = "conv", "full_attention"
PROJECTOR_EPS = 1e-6  # the projector's LayerNorm
# Lfm3VlVisionConfig's default RoPE base where its rope_parameters give none.
DEFAULT_THETA = 1_000_000.0
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class EncoderArgs:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_types: tuple[str, ...]
    text_hidden_size: int  # what the projector gives
    projector_hidden_size: int = 4096
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    conv_kernel_size: int = 3
    norm_eps: float = 1e-5
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = DEFAULT_THETA

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - {CONV, ATTENTION})
        if unknown:
            raise UnsupportedError(f"LFM3-VL vision layer types {unknown} are not supported")
        if self.projector_hidden_act not in _ACTIVATIONS:
            raise UnsupportedError(
                f"LFM3-VL projector activation {self.projector_hidden_act!r} is not supported"
            )
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads or self.head_dim % 4 or heads % kv:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {heads} heads of a multiple "
                f"of 4 features in groups over {kv} key/value heads"
            )
        if self.conv_kernel_size % 2 == 0:
            raise ModelFormatError(
                f"vision conv_kernel_size {self.conv_kernel_size}: an odd size keeps the grid"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], text_hidden: int) -> EncoderArgs:
        """From an lfm3_vl config.json dict (Lfm3VlVisionConfig's defaults where it has
        none); `text_hidden`: the language model's width."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelFormatError("an lfm3_vl config.json without a vision_config")
        layers = vision.get("num_hidden_layers", 14)
        types = vision.get("layer_types") or [
            CONV if i < 2 or i % 2 else ATTENTION for i in range(layers)
        ]
        if len(types) != layers:
            raise ModelFormatError(
                f"vision layer_types lists {len(types)} layers, but num_hidden_layers is {layers}"
            )
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedError(f"LFM3-VL vision RoPE type {rope['rope_type']!r}")
        return cls(
            hidden_size=vision.get("hidden_size", 1024),
            intermediate_size=vision.get("intermediate_size", 2560),
            num_attention_heads=vision.get("num_attention_heads", 16),
            num_key_value_heads=vision.get("num_key_value_heads", 8),
            layer_types=tuple(types),
            text_hidden_size=text_hidden,
            projector_hidden_size=config.get("projector_hidden_size", 4096),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("projector_bias", True),
            conv_kernel_size=vision.get("conv_kernel_size", 3),
            norm_eps=vision.get("norm_eps", 1e-5),
            patch_size=vision.get("patch_size", 16),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            in_channels=vision.get("in_channels", 3),
            rope_theta=rope.get("rope_theta", DEFAULT_THETA),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def to_grid(x: torch.Tensor, grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """Patches [h * w, C] in the processor's 2x2-group order -> [C, h, w] on their grid."""
    channels = x.shape[-1]
    grouped = x.view(grid_h // merge, grid_w // merge, merge, merge, channels)
    return grouped.permute(4, 0, 2, 1, 3).reshape(channels, grid_h, grid_w)


def from_grid(x: torch.Tensor, merge: int) -> torch.Tensor:
    """[C, h, w] -> [h * w, C] in the processor's 2x2-group order (to_grid's inverse)."""
    channels, grid_h, grid_w = x.shape
    grouped = x.view(channels, grid_h // merge, merge, grid_w // merge, merge)
    return grouped.permute(1, 3, 2, 4, 0).reshape(grid_h * grid_w, channels)


class ShortConv(nn.Module):
    """out_proj(output_gate * conv2d(input_gate * input)), the depthwise convolution over
    the grid of patches, zero-padded at its edges."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.merge = args.spatial_merge_size
        hidden, kernel = args.hidden_size, args.conv_kernel_size
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.spatial_conv = nn.Conv2d(
            hidden, hidden, kernel, padding=kernel // 2, groups=hidden, bias=False
        )
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        input_gate, output_gate, conv_input = self.in_proj(x).chunk(3, dim=-1)
        grid = to_grid(input_gate * conv_input, grid_h, grid_w, self.merge)
        convolved = from_grid(self.spatial_conv(grid[None])[0], self.merge)
        return self.out_proj(output_gate * convolved)


class Attention(nn.Module):
    """The whole image attends to itself; each query head to its group's key/value head."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        hidden, head_dim = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(hidden, self.heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(self.heads * head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(head_dim, args.norm_eps)
        self.k_layernorm = RMSNorm(head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        # [N, heads * head_dim] -> [N, heads, head_dim], normalized per head, rotated
        q = rotate_heads(self.q_layernorm(self.q_proj(x).view(n, self.heads, -1)), cos, sin)
        k = rotate_heads(self.k_layernorm(self.k_proj(x).view(n, self.kv_heads, -1)), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, -1)
        group = self.heads // self.kv_heads
        # [N, kv, head_dim] -> [1, heads, N, head_dim], each key/value head repeated in a run
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1)[None] for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v)
        return self.out_proj(out[0].transpose(0, 1).reshape(n, -1))


class FeedForward(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    """x + operator(operator_norm(x)), then x + feed_forward(ffn_norm(x))."""

    def __init__(self, args: EncoderArgs, kind: str) -> None:
        super().__init__()
        if kind == CONV:
            self.conv = ShortConv(args)
        else:
            self.self_attn = Attention(args)
        self.feed_forward = FeedForward(args)
        self.operator_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], grid: tuple[int, int]
    ) -> torch.Tensor:
        normed = self.operator_norm(x)
        if hasattr(self, "conv"):
            x = x + self.conv(normed, *grid)
        else:
            x = x + self.self_attn(normed, *rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Tower(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        patch = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.patchifier = nn.Linear(patch, args.hidden_size, bias=False)
        self.embedding_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.layers = nn.ModuleList(Layer(args, kind) for kind in args.layer_types)


class Projector(nn.Module):
    """Each patch LayerNormed, each 2x2 group concatenated, through Linear-GELU-Linear."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size**2
        bias = args.projector_bias
        self.act = _ACTIVATIONS[args.projector_hidden_act]
        self.layer_norm = nn.LayerNorm(args.hidden_size, eps=PROJECTOR_EPS)
        self.linear_1 = nn.Linear(self.width, args.projector_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x).view(-1, self.width))))


class VisionModel(nn.Module):
    """Patches [grid_h * grid_w, C * frames * patch²] of one image -> merged tokens
    [grid_h/m * grid_w/m, text_hidden_size] row by row."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = Tower(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        tower = self.vision_tower
        x = tower.embedding_norm(tower.patchifier(patches))
        rope = rotary_angles(self.args, grid_h, grid_w)
        for layer in tower.layers:
            x = layer(x, rope, (grid_h, grid_w))
        return self.multi_modal_projector(x)
