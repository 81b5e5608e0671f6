"""Nemotron 3 Nano Omni's image encoder: the RADIO ViT, a pixel shuffle and the MLP
projector; an image's patches -> one token per 2x2 patches, in the language model's width.

Each patch (channel-major, 3 x patch_size²) through a linear embedding, plus the learned
square table of position embeddings resized bilinearly to a square of the grid's longer
side and cropped to the grid; the class and
register tokens before the patches; pre-norm blocks of attention over the whole image and
a GELU MLP, each scaled per channel (LayerScale); the prefix tokens dropped, a LayerNorm
where the checkpoint's language model has MTP layers, each 2x2 group of patches
concatenated (pixel shuffle), then an RMSNorm and a squared-ReLU MLP.

The patches come row by row, as NemotronH_Omni_Reasoning_V3ImageProcessor flattens them
(llmrun.nemotron_omni_images); the tokens come out row by row of 2x2 groups.

Reference: transformers/models/radio/modeling_radio.py (RadioModel, RadioPatchEmbeddings)
and transformers/models/nemotron_h_omni/modeling_nemotron_h_omni.py
(get_image_features, pixel_shuffle, NemotronH_Omni_Reasoning_V3MultiModalProjector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import RMSNorm

PROJECTOR_EPS = 1e-5  # the projector's RMSNorm's


@dataclass
class EncoderArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    out_hidden_size: int  # the language model's width
    projector_hidden_size: int
    max_img_size: int = 2048
    patch_size: int = 16
    num_cls_tokens: int = 3
    num_registers: int = 7
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    merge_size: int = 2  # 1 / downsample_ratio
    final_norm: bool = False  # the LayerNorm before the pixel shuffle

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"vision hidden_size {self.hidden_size} is not {self.num_attention_heads} heads"
            )
        if self.max_img_size < self.patch_size:
            raise ModelFormatError(
                f"vision max_img_size {self.max_img_size} is under a patch of {self.patch_size}"
            )
        if self.intermediate_size <= 0:
            raise UnsupportedError(f"vision mlp_ratio {self.mlp_ratio} gives no MLP")

    @property
    def intermediate_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def table_side(self) -> int:
        """The position table's side: max_img_size // patch_size positions."""
        return self.max_img_size // self.patch_size

    @property
    def prefix_tokens(self) -> int:
        return self.num_cls_tokens + self.num_registers


class Embeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_projection = nn.Linear(3 * args.patch_size**2, args.hidden_size, bias=False)
        self.position_embedding = nn.Parameter(torch.empty(1, args.table_side**2, args.hidden_size))
        self.cls_register_token = nn.Parameter(torch.empty(args.prefix_tokens, args.hidden_size))

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """The table resized to the grid: [grid_h * grid_w, hidden], row by row."""
        side = self.args.table_side
        # [1, side², C] -> [1, C, side, side]
        table = self.position_embedding.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        longer = max(grid_h, grid_w)
        table = F.interpolate(table, size=(longer, longer), mode="bilinear", align_corners=False)
        return table[..., :grid_h, :grid_w].flatten(2)[0].T

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        x = self.patch_projection(patches) + self.positions(grid_h, grid_w)
        return torch.cat([self.cls_register_token, x])


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=args.qkv_bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=args.qkv_bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=args.qkv_bias)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        # [T, C] -> [heads, T, head_dim]
        q, k, v = (
            p(x).view(tokens, self.heads, -1).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(0, 1).reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.empty(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.lambda1


class Layer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attention = Attention(args)
        self.layer_scale1 = LayerScale(args.hidden_size)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MLP(args)
        self.layer_scale2 = LayerScale(args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.layer_scale1(self.attention(self.norm1(x)))
        return x + self.layer_scale2(self.mlp(self.norm2(x)))


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        merged = args.hidden_size * args.merge_size**2
        self.layer_norm = RMSNorm(merged, PROJECTOR_EPS)
        self.linear_1 = nn.Linear(merged, args.projector_hidden_size, bias=False)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.out_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x))).square())


class ImageEncoder(nn.Module):
    """RADIO, the pixel shuffle and the projector, under transformers' module names."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        if args.final_norm:
            self.vision_final_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.multi_modal_projector = Projector(args)

    def features(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """The tower's patch features [grid_h * grid_w, hidden] (prefix tokens dropped)."""
        x = self.embeddings(patches, grid_h, grid_w)
        for layer in self.encoder.layer:
            x = layer(x)
        return x[self.args.prefix_tokens :]

    def shuffled(self, features: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """Each merge x merge group of patch features as one row [tokens, hidden * merge²],
        in the order of transformers' pixel_shuffle."""
        merge = self.args.merge_size
        channels = features.shape[-1]
        # [h, w, C] -> [h, w / m, C m] -> [w / m, h, C m] -> [w / m, h / m, C m²] -> [h / m, ...]
        x = features.reshape(grid_h, grid_w // merge, channels * merge).transpose(0, 1)
        x = x.reshape(grid_w // merge, grid_h // merge, channels * merge**2).transpose(0, 1)
        return x.reshape(-1, channels * merge**2)

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """An image's tokens [grid_h * grid_w / merge², out_hidden] from its flattened
        patches [grid_h * grid_w, 3 * patch²], row by row."""
        merge = self.args.merge_size
        if grid_h % merge or grid_w % merge or patches.shape[0] != grid_h * grid_w:
            raise ValueError(f"a {grid_h}x{grid_w} grid of {patches.shape[0]} patches")
        features = self.features(patches, grid_h, grid_w)
        if self.args.final_norm:
            features = self.vision_final_layernorm(features)
        return self.multi_modal_projector(self.shuffled(features, grid_h, grid_w))
