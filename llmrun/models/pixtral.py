"""Mistral 3's image encoder (Mistral Small 3.1/3.2), and LightOnOCR's: an image of any
size (sides multiples of patch_size * spatial_merge_size for Mistral 3, of patch_size for
LightOnOCR) -> one token in the language model's width per 2x2 group of patches, row by
row.

Pixtral's vision transformer: patches through a strided convolution, RMSNorm, pre-norm
layers (RMSNorm, attention with 2D RoPE, where the first half of each head's frequencies
turn by the patch's row and the second half by its column; RMSNorm, SwiGLU), no final norm.
Mistral 3's projector: RMSNorm, the patch merger (each 2x2 group of patches concatenated as
torch's unfold orders them, then a linear layer), linear-GELU-linear.

Reference: transformers/models/pixtral/modeling_pixtral.py (PixtralVisionModel),
transformers/models/mistral3/modeling_mistral3.py (Mistral3MultiModalProjector,
Mistral3Model.get_image_features), transformers/models/lighton_ocr/modeling_lighton_ocr.py
(LightOnOcrMultiModalProjector: the same without biases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm, activation
from llmrun.models.vision_rope import rotate

# PixtralAttentionLayer's and PixtralVisionModel.ln_pre's epsilon, fixed in transformers.
PIXTRAL_NORM_EPS = 1e-5


@dataclass
class VisionArgs:
    """A PixtralVisionConfig's fields; image_size is the longest side an image is resized
    to fit."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0
    norm_eps: float = PIXTRAL_NORM_EPS

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads of a multiple of 4 (2D RoPE's four parts)"
            )
        activation(self.hidden_act)  # refuses an unknown one

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a PixtralVisionConfig dict (a vision_config)."""
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise UnsupportedError(f"Pixtral's vision RoPE type {rope['rope_type']!r}")
        theta = rope.get("rope_theta", config.get("rope_theta")) or 10000.0
        try:
            return cls(
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"],
                image_size=config["image_size"],
                patch_size=config["patch_size"],
                num_channels=config.get("num_channels", 3),
                hidden_act=config.get("hidden_act") or "gelu",
                rope_theta=float(theta),
            )
        except KeyError as e:
            raise ModelFormatError(f"the vision_config has no {e.args[0]}") from None


@dataclass
class EncoderArgs:
    """A Mistral3Config's image fields: the tower's, and the projector's."""

    vision: VisionArgs
    text_hidden_size: int
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = False
    vision_feature_layer: int = -1
    norm_eps: float = 1e-5  # the projector's RMSNorm: the text model's rms_norm_eps

    def __post_init__(self) -> None:
        layers = self.vision.num_hidden_layers
        if not isinstance(self.vision_feature_layer, int) or not (
            -layers - 1 <= self.vision_feature_layer <= layers
        ):
            raise UnsupportedError(
                f"vision_feature_layer {self.vision_feature_layer!r}: llmrun takes one layer "
                f"of the {layers}"
            )
        if self.spatial_merge_size < 1:
            raise ModelFormatError(f"spatial_merge_size {self.spatial_merge_size}")
        activation(self.projector_hidden_act)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Mistral3ForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a Mistral 3 config without vision_config and text_config")
        return cls(
            VisionArgs.from_config(vision),
            text["hidden_size"],
            config.get("spatial_merge_size", 2),
            config.get("projector_hidden_act") or "gelu",
            bool(config.get("multimodal_projector_bias", False)),
            config.get("vision_feature_layer", -1),
            text.get("rms_norm_eps") or 1e-6,  # MistralConfig's default
        )

    @property
    def layers_run(self) -> int:
        """How many tower layers feed the projector (the hidden state it takes: 0 is the
        normed patches, -1 the last layer's output)."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.vision.num_hidden_layers + 1 + layer

    @property
    def unit(self) -> int:
        """The pixels of a merged token's side: an image's sides are multiples of it."""
        return self.vision.patch_size * self.spatial_merge_size


def rope_2d(args: VisionArgs, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows * cols, head_dim] of the patches, row by row: frequency i of the
    head's half turns by the row for even i and by the column for odd i, the row's
    first (PixtralVisionRotaryEmbedding), both halves alike (rotate_half)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    angles = torch.cat(
        [row.reshape(-1, 1) * inv_freq[0::2], col.reshape(-1, 1) * inv_freq[1::2]], dim=-1
    )
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        patches, dim = x.shape
        # [P, dim] -> [heads, P, head_dim]; every patch of the image sees every other.
        q, k, v = (
            proj(x).view(patches, self.heads, -1).transpose(0, 1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.o_proj(out.transpose(0, 1).reshape(patches, dim))


class FeedForward(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.act = activation(args.hidden_act)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class AttentionLayer(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AttentionLayer(args) for _ in range(args.num_hidden_layers))


class VisionModel(nn.Module):
    """Pixels [C, H, W] -> hidden states [H/p * W/p, hidden], row by row, with HF's
    module names (PixtralVisionModel: patch_conv, ln_pre, transformer.layers)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        size = args.patch_size
        self.patch_conv = nn.Conv2d(
            args.num_channels, args.hidden_size, size, stride=size, bias=False
        )
        self.ln_pre = RMSNorm(args.hidden_size, args.norm_eps)
        self.transformer = Transformer(args)

    def forward(self, pixels: torch.Tensor, layers: int | None = None) -> torch.Tensor:
        """The hidden state after the first `layers` layers (default: all)."""
        # [C, H, W] -> [hidden, rows, cols] -> [rows * cols, hidden]
        patches = self.patch_conv(pixels[None])[0]
        rows, cols = patches.shape[1:]
        x = self.ln_pre(patches.flatten(1).T)
        cos, sin = rope_2d(self.args, rows, cols)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.transformer.layers[:layers]:
            x = layer(x, cos, sin)
        return x


class PatchMerger(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.merge = args.spatial_merge_size
        hidden = args.vision.hidden_size
        self.merging_layer = nn.Linear(hidden * self.merge**2, hidden, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        m, hidden = self.merge, x.shape[-1]
        # A last row or column of patches short of m is left out, as F.unfold leaves it.
        grid = x.view(rows, cols, hidden)[: rows // m * m, : cols // m * m]
        # [rows, cols, hidden] -> [rows/m, m, cols/m, m, hidden] -> [rows/m, cols/m,
        # hidden, m, m] -> [tokens, hidden * m * m]: F.unfold's order, a channel's m x m
        # patches together.
        groups = grid.reshape(rows // m, m, cols // m, m, hidden).permute(0, 2, 4, 1, 3)
        return self.merging_layer(groups.reshape(-1, hidden * m * m))


class MultiModalProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        vision, text, bias = (
            args.vision.hidden_size,
            args.text_hidden_size,
            args.multimodal_projector_bias,
        )
        self.norm = RMSNorm(vision, args.norm_eps)
        self.patch_merger = PatchMerger(args)
        self.linear_1 = nn.Linear(vision, text, bias=bias)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        merged = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))


class ImageEncoder(nn.Module):
    """Pixels [C, H, W] -> the image's tokens [H//u, W//u, text hidden] (u = args.unit;
    the sides are multiples of the patch size, and of u for Mistral 3, whose processor
    resizes so: LightOnOCR's need not be), with HF's module names (vision_tower,
    multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        unit, patch = self.args.unit, self.args.vision.patch_size
        height, width = pixels.shape[-2:]
        if height % patch or width % patch or height < unit or width < unit:
            raise ValueError(
                f"image sides {height}x{width} are not multiples of {patch} from {unit}"
            )
        states = self.vision_tower(pixels, self.args.layers_run)
        tokens = self.multi_modal_projector(states, height // patch, width // patch)
        return tokens.view(height // unit, width // unit, -1)
