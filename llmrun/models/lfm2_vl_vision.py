"""LFM2-VL's image encoder: an image's patches -> soft tokens in the language model's
width. A SigLIP2 NaFlex tower (llmrun.models.siglip's layers) takes a frame of any
patch grid: each patch of patch_size² pixels (flattened row, column, channel) through a
linear patch embedding, plus the learned square grid of position embeddings resized
bilinearly (antialiased) to the frame's grid; then the projector: a pixel unshuffle that
folds each downsample_factor² square of patches into one token, a LayerNorm and a
two-layer GELU MLP. A frame is encoded alone, so no patch is padding and no attention
mask is needed (transformers pads frames to one length and masks the padding out).

Reference: transformers/models/lfm2_vl/modeling_lfm2_vl.py (Lfm2VlModel.get_image_features,
Lfm2VlMultiModalProjector) and siglip2/modeling_siglip2.py (Siglip2VisionEmbeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import siglip
from llmrun.models.base import activation

# Siglip2VisionConfig's defaults, for the fields a config.json leaves out.
VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "patch_size": 16,
    "num_patches": 256,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}


@dataclass
class EncoderArgs:
    # The tower; its image_size is the position grid's side in pixels (the grid is
    # image_size / patch_size patches a side).
    vision: siglip.VisionArgs
    text_hidden_size: int
    projector_hidden_size: int
    downsample_factor: int = 2
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    projector_use_layernorm: bool = True

    def __post_init__(self) -> None:
        if self.downsample_factor < 1:
            raise ModelFormatError(f"downsample_factor is {self.downsample_factor}")
        activation(self.projector_hidden_act)  # refuses an unknown one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an Lfm2VlForConditionalGeneration config.json dict; the tower keeps its
        layers up to vision_feature_layer (-1: all of them)."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelFormatError("an lfm2_vl config without vision_config or text_config")
        if "hidden_size" not in text:
            raise ModelFormatError("an lfm2_vl text_config without hidden_size")
        vision = {**VISION_DEFAULTS, **{k: v for k, v in vision.items() if v is not None}}
        side = math.isqrt(vision["num_patches"])
        if side * side != vision["num_patches"]:
            raise ModelFormatError(
                f"vision num_patches {vision['num_patches']} is not a square grid of positions"
            )
        layers = vision["num_hidden_layers"]
        feature_layer = config.get("vision_feature_layer", -1)
        if not isinstance(feature_layer, int) or not -layers <= feature_layer < layers:
            raise ModelFormatError(
                f"vision_feature_layer {feature_layer!r} is not one of the tower's {layers} layers"
            )
        vision["num_hidden_layers"] = feature_layer % layers + 1
        vision["image_size"] = side * vision["patch_size"]
        return cls(
            siglip.VisionArgs.from_config(vision),
            text_hidden_size=text["hidden_size"],
            projector_hidden_size=config.get("projector_hidden_size", 2560),
            downsample_factor=config.get("downsample_factor", 2),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("projector_bias", True),
            projector_use_layernorm=config.get("projector_use_layernorm", True),
        )


class Embeddings(nn.Module):
    def __init__(self, args: siglip.VisionArgs) -> None:
        super().__init__()
        self.side = args.patches_per_side
        width = args.num_channels * args.patch_size**2
        self.patch_embedding = nn.Linear(width, args.hidden_size)
        self.position_embedding = nn.Embedding(self.side**2, args.hidden_size)

    def forward(self, patches: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """Patches [N, rows * columns, channels * patch²] of frames of rows x columns
        patches -> [N, rows * columns, hidden]."""
        grid = self.position_embedding.weight.reshape(self.side, self.side, -1)
        # [side, side, hidden] -> [1, hidden, rows, columns] -> [rows * columns, hidden]
        grid = F.interpolate(
            grid.permute(2, 0, 1)[None].float(),
            size=(rows, columns),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        positions = grid[0].flatten(1).transpose(0, 1)
        return self.patch_embedding(patches) + positions.to(patches.dtype)


class Tower(nn.Module):
    """Siglip2VisionModel's embeddings, encoder layers and final norm, under HF's names."""

    def __init__(self, args: siglip.VisionArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = siglip.Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, patches: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        x = self.embeddings(patches, rows, columns)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_unshuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Patch states [N, rows, columns, dim] -> [N, rows / f, columns / f, dim * f²], each
    token a f x f square of patches, in Lfm2VlMultiModalProjector's order (the square's
    states row by row)."""
    batch, rows, columns, dim = x.shape
    # [N, rows, columns / f, dim * f]: f neighbours along a row side by side
    x = x.reshape(batch, rows, columns // factor, dim * factor).permute(0, 2, 1, 3)
    # [N, columns / f, rows / f, dim * f²]: then f neighbouring rows
    x = x.reshape(batch, columns // factor, rows // factor, dim * factor * factor)
    return x.permute(0, 2, 1, 3)


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        width = args.vision.hidden_size * args.downsample_factor**2
        self.factor = args.downsample_factor
        self.layer_norm = nn.LayerNorm(width) if args.projector_use_layernorm else None
        bias = args.projector_bias
        self.linear_1 = nn.Linear(width, args.projector_hidden_size, bias=bias)
        self.act = activation(args.projector_hidden_act)
        self.linear_2 = nn.Linear(args.projector_hidden_size, args.text_hidden_size, bias=bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x = pixel_unshuffle(states, self.factor)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEncoder(nn.Module):
    """Frames' patches [N, rows * columns, channels * patch²] -> soft tokens
    [N, rows / f * columns / f, text hidden], row by row; HF's module names
    (vision_tower, multi_modal_projector)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = Tower(args.vision)
        self.multi_modal_projector = Projector(args)

    def forward(self, patches: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        factor = self.args.downsample_factor
        if rows % factor or columns % factor:
            raise ValueError(f"a grid of {rows}x{columns} patches does not downsample by {factor}")
        states = self.vision_tower(patches, rows, columns)
        tokens = self.multi_modal_projector(states.reshape(len(patches), rows, columns, -1))
        return tokens.flatten(1, 2)
