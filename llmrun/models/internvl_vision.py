"""InternVL's image encoder (InternVL 2.5, 3 and 3.5): tiles [N, 3, S, S] -> soft tokens
[N, tokens per tile, text hidden].

InternViT: patches through a strided convolution, a class token in front, absolute
position embeddings (interpolated bicubically where the tile's grid of patches differs from
the trained one); pre-norm layers (LayerNorm, or RMSNorm for the 6B ViT), attention with q/k
RMS norms where the config asks, each branch scaled per feature (layer scale) before its
residual. The class token is dropped, the patch grid pixel-shuffled (each 2x2 block of
patches into one token of 4x the features, for downsample_ratio 0.5) and projected by
LayerNorm, Linear, GELU, Linear to the language model's width.

Reference: transformers/models/internvl/modeling_internvl.py (InternVLVisionModel,
InternVLMultiModalProjector, InternVLModel.get_image_features and pixel_shuffle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm, activation

NORM_TYPES = ("layer_norm", "rms_norm")


def _side(value: Any, name: str) -> int:
    """A square image or patch size: an int, or [h, w] with h == w."""
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedError(f"vision {name} {value!r}: llmrun runs square ones")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelFormatError(f"vision {name} is {value!r}, not a size in pixels")
    return value


@dataclass
class VisionArgs:
    """InternVLVisionConfig's fields that shape the tower (HF names and defaults)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    image_size: int = 448
    patch_size: int = 14
    attention_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    use_absolute_position_embeddings: bool = True
    use_mean_pooling: bool = True

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ModelFormatError(
                f"vision image_size {self.image_size} is not a multiple of patch_size "
                f"{self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not a multiple of its "
                f"{self.num_attention_heads} heads"
            )
        if self.norm_type not in NORM_TYPES:
            raise UnsupportedError(
                f"vision norm_type {self.norm_type!r} (supported: {', '.join(NORM_TYPES)})"
            )
        activation(self.hidden_act)  # refuses an unknown one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From an InternVLVisionConfig dict (a vision_config)."""
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in config.items() if k in names and v is not None}
        for name in ("image_size", "patch_size"):
            values[name] = _side(values.get(name, getattr(cls, name)), name)
        return cls(**values)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class EncoderArgs:
    vision: VisionArgs
    text_hidden_size: int
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        # transformers takes int(1 / ratio) as the side of a block of patches merged.
        ratio = self.downsample_ratio
        number = isinstance(ratio, int | float) and not isinstance(ratio, bool)
        if not number or not 0 < ratio <= 1 or self.merge * ratio != 1:
            raise ModelFormatError(f"downsample_ratio {ratio!r} is not 1 / a whole number")
        if self.vision.patches_per_side % self.merge:
            raise ModelFormatError(
                f"downsample_ratio {self.downsample_ratio} does not divide the "
                f"{self.vision.patches_per_side} patches a side of an image"
            )
        activation(self.projector_hidden_act)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an InternVLForConditionalGeneration config.json dict."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("an InternVL config without vision_config and text_config")
        layer = config.get("vision_feature_layer", -1)
        strategy = config.get("vision_feature_select_strategy", "default")
        if layer != -1 or strategy != "default":
            raise UnsupportedError(
                f"InternVL image features from vision_feature_layer {layer!r} with strategy "
                f"{strategy!r}; llmrun takes the last layer's patches (-1, 'default')"
            )
        width = text.get("hidden_size")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ModelFormatError(f"text_config's hidden_size is {width!r}")
        return cls(
            VisionArgs.from_config(vision),
            width,
            config.get("downsample_ratio", 0.5),
            config.get("projector_hidden_act", "gelu"),
        )

    @property
    def merge(self) -> int:
        """The side of each square of patches pixel-shuffled into one token."""
        return int(1 / self.downsample_ratio)

    def tokens_per_tile(self, tile: int) -> int:
        """The soft tokens of a tile `tile` pixels a side."""
        return (tile // self.vision.patch_size // self.merge) ** 2


def _norm(args: VisionArgs, dim: int) -> nn.Module:
    if args.norm_type == "rms_norm":
        return RMSNorm(dim, args.layer_norm_eps)
    return nn.LayerNorm(dim, eps=args.layer_norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        size = args.patch_size
        self.projection = nn.Conv2d(args.num_channels, args.hidden_size, size, stride=size)


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.cls_token = nn.Parameter(torch.zeros(1, 1, args.hidden_size))
        self.patch_embeddings = PatchEmbeddings(args)
        if args.use_absolute_position_embeddings:
            positions = args.patches_per_side**2 + 1
            self.position_embeddings = nn.Parameter(torch.zeros(1, positions, args.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, C, H, W] -> [N, hidden, H/p, W/p] -> [N, patches, hidden], patches row by row
        grid = self.patch_embeddings.projection(pixels)
        rows, columns = grid.shape[2:]
        x = torch.cat([self.cls_token.expand(len(pixels), -1, -1), grid.flatten(2).mT], dim=1)
        if not self.args.use_absolute_position_embeddings:
            return x
        return x + self._positions(rows, columns)

    def _positions(self, rows: int, columns: int) -> torch.Tensor:
        """The position embeddings of a rows x columns grid: the trained square's where it
        is that grid, else its patch part resized bicubically (interpolate_pos_encoding)."""
        table = self.position_embeddings
        side = self.args.patches_per_side
        if rows == columns == side:
            return table
        dim = table.shape[-1]
        # [1, side², dim] -> [1, dim, side, side] -> [1, dim, rows, columns] -> [1, rows*columns, dim]
        square = table[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
        resized = F.interpolate(square, size=(rows, columns), mode="bicubic", align_corners=False)
        return torch.cat([table[:, :1], resized.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.projection_layer = nn.Linear(dim, dim)
        # Over all heads' features together; transformers' InternVLVisionRMSNorm, eps 1e-6.
        self.q_norm = RMSNorm(dim, 1e-6) if args.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(dim, 1e-6) if args.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        # [N, T, dim] -> [N, heads, T, head_dim]
        q, k, v = (
            t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, self.v_proj(x))
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection_layer(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.act = activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    """x + lambda_1 * attention(norm(x)), then x + lambda_2 * mlp(norm(x))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.attention = Attention(args)
        self.mlp = MLP(args)
        self.layernorm_before = _norm(args, dim)
        self.layernorm_after = _norm(args, dim)
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class VisionModel(nn.Module):
    """Tiles [N, C, H, W] -> hidden states [N, 1 + patches, hidden], the class token first
    (InternVLVisionModel's last_hidden_state)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        # Without mean pooling, a final LayerNorm (InternVL's configs mean-pool: none).
        self.layernorm = (
            nn.Identity()
            if args.use_mean_pooling
            else nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)


def pixel_shuffle(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[N, side, side, C] -> [N, side/merge, side/merge, C*merge²], as transformers'
    InternVLModel.pixel_shuffle orders the features of each merge x merge block."""
    batch, width, height, channels = grid.shape
    x = grid.reshape(batch, width, height // merge, channels * merge)
    x = x.permute(0, 2, 1, 3).reshape(batch, height // merge, width // merge, channels * merge**2)
    return x.permute(0, 2, 1, 3)


class MultiModalProjector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.vision.hidden_size * args.merge**2
        self.layer_norm = nn.LayerNorm(width)  # PyTorch's default eps, as transformers'
        self.linear_1 = nn.Linear(width, args.text_hidden_size)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class ImageEncoder(nn.Module):
    """Tiles [N, 3, S, S] -> soft tokens [N, (S / patch / merge)², text hidden], with HF's
    module names (vision_tower, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionModel(args.vision)
        self.multi_modal_projector = MultiModalProjector(args)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        patches = self.vision_tower(tiles)[:, 1:]  # the class token dropped
        batch, count, hidden = patches.shape
        side = int(count**0.5)
        if side * side != count:
            raise ValueError(f"a tile of {count} patches is not square")
        shuffled = pixel_shuffle(patches.reshape(batch, side, side, hidden), self.args.merge)
        return self.multi_modal_projector(shuffled.reshape(batch, -1, shuffled.shape[-1]))
