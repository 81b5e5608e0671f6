"""Step 3.7's image encoder: a view [N, 3, S, S] (the global view of image_size pixels, or
a local crop of another size) -> its soft tokens [N, (S / patch / 4)², text hidden].

A ViT: patches through a strided convolution (no bias) plus learned positions (the
image_size grid's, bilinearly resized to another grid), a LayerNorm before the layers,
then pre-norm layers whose attention turns queries and keys by a 2-D RoPE (per head: a
quarter of the dimensions' frequencies by column, the next quarter by row, repeated for
the rotated half) and whose attention and quick-GELU MLP outputs are scaled per channel
(lambda_1, lambda_2) before the residual add. The patch grid then goes through two
stride-2 3x3 convolutions (each doubling the channels: downsampler1, downsampler2) and one
linear projection (multi_modal_projector) to the language model's width.

Reference: transformers/models/step3p7/modeling_step3p7.py (Step3p7VisionModel,
Step3p7Model.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.llava_vision import quick_gelu

MLP_RATIO = 8960 / 1536  # Step3p7VisionConfig's
DOWNSAMPLE = 4  # two stride-2 convolutions


@dataclass
class EncoderArgs:
    """Step3p7VisionConfig's fields (HF names and defaults; StepFun's own config.json names
    width, layers, heads are read too) and the language model's width."""

    text_hidden_size: int
    hidden_size: int = 1536
    num_hidden_layers: int = 47
    num_attention_heads: int = 16
    image_size: int = 728
    patch_size: int = 14
    mlp_ratio: float = MLP_RATIO
    # None: int(hidden_size * mlp_ratio), as Step3p7VisionConfig derives it whatever
    # intermediate_size its file gives.
    intermediate_size: int | None = None
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    projector_bias: bool = False
    num_channels: int = 3

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            self.intermediate_size = int(self.hidden_size * self.mlp_ratio)
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"vision {name} is {value!r}")
        if self.hidden_size % (4 * self.num_attention_heads):
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads a multiple of 4 wide (a 2-D RoPE's)"
            )
        if self.image_size % (self.patch_size * DOWNSAMPLE):
            raise ModelFormatError(
                f"vision image_size {self.image_size} is not a multiple of {DOWNSAMPLE} "
                f"patches of {self.patch_size}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From a Step3p7ForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("a step3p7 config without vision_config or text_config")
        if not isinstance(text.get("hidden_size"), int):
            raise ModelFormatError("a step3p7 text_config without hidden_size")
        values: dict[str, Any] = {}
        for name, hub in (
            ("hidden_size", "width"),
            ("num_hidden_layers", "layers"),
            ("num_attention_heads", "heads"),
        ):
            value = vision.get(hub, vision.get(name))
            if value is not None:
                values[name] = value
        for name in ("image_size", "patch_size", "mlp_ratio", "layer_norm_eps", "num_channels"):
            if vision.get(name) is not None:
                values[name] = vision[name]
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelFormatError(f"vision rope_type {rope['rope_type']!r}, not axial")
        values["rope_theta"] = float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))
        if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ModelFormatError(f"vision hidden_act {vision['hidden_act']!r}, not quick_gelu")
        return cls(
            text_hidden_size=text["hidden_size"],
            projector_bias=bool(config.get("projector_bias", False)),
            **values,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tokens(self, side: int) -> int:
        """The soft tokens of a square view `side` pixels wide."""
        return (side // (self.patch_size * DOWNSAMPLE)) ** 2


def rope_2d(args: EncoderArgs, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows * columns, head_dim] of a patch grid (row by row):
    Step3p7VisionRotaryEmbedding's column frequencies, then its row frequencies, twice."""
    spatial = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    positions = torch.stack([column.flatten(), row.flatten()], dim=-1)
    # [patches, 2, spatial / 2] -> [patches, spatial]
    angles = (positions[..., None].float() * inv_freq).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # [N, L, hidden] -> [N, heads, L, head_dim]
        shape = (batch, length, self.heads, -1)
        cos, sin = cos[:, None], sin[:, None]
        q = _rotate(self.q_proj(x).view(shape), cos, sin).transpose(1, 2)
        k = _rotate(self.k_proj(x).view(shape), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(quick_gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.layernorm_before = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.lambda_1 = nn.Parameter(torch.ones(args.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(args.hidden_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.self_attn(self.layernorm_before(x), cos, sin)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.patch = args.patch_size
        self.side = args.image_size // args.patch_size
        self.patch_embedding = nn.Conv2d(
            args.num_channels, args.hidden_size, args.patch_size, stride=args.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(self.side**2, args.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, C, H, W] -> [N, patches, hidden], patches row by row
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        rows, columns = pixels.shape[2] // self.patch, pixels.shape[3] // self.patch
        return patches + positions(self.position_embedding.weight, self.side, rows, columns)


def positions(table: torch.Tensor, side: int, rows: int, columns: int) -> torch.Tensor:
    """The position rows [rows * columns, hidden] of a patch grid: the side x side table's,
    bilinearly resized (not antialiased) where the grid is another."""
    if (rows, columns) == (side, side):
        return table
    grid = table.view(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(rows, columns), mode="bilinear", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(rows * columns, -1)


class VisionModel(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        dim = args.hidden_size
        self.embeddings = Embeddings(args)
        self.pre_layernorm = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.downsampler1 = nn.Conv2d(dim, dim * 2, kernel_size=3, stride=2, padding=1)
        self.downsampler2 = nn.Conv2d(dim * 2, dim * 4, kernel_size=3, stride=2, padding=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        rows, columns = (side // self.args.patch_size for side in pixels.shape[2:])
        cos, sin = rope_2d(self.args, rows, columns)
        x = self.pre_layernorm(self.embeddings(pixels))
        for layer in self.layers:
            x = layer(x, cos, sin)
        # [N, patches, hidden] -> [N, hidden, rows, columns] -> [N, tokens, 4 hidden]
        grid = x.transpose(1, 2).reshape(x.shape[0], -1, rows, columns)
        return self.downsampler2(self.downsampler1(grid)).flatten(2).transpose(1, 2)


class ImageEncoder(nn.Module):
    """Views [N, 3, S, S] (all of one size) -> soft tokens [N, tokens(S), text hidden], with
    HF's module names (vision_model, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionModel(args)
        self.multi_modal_projector = nn.Linear(
            args.hidden_size * 4, args.text_hidden_size, bias=args.projector_bias
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_model(pixels))
