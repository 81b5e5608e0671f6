"""SigLIP's vision transformer: an image [3, H, W] -> one hidden state per patch, the
vision tower of Gemma 3 (and of PaliGemma, Idefics3, ...).

Patches of patch_size² pixels through a strided convolution, plus a learned position
embedding per patch; pre-norm encoder layers (LayerNorm, attention where every patch sees
every patch, LayerNorm, GELU MLP), a final LayerNorm.

Reference: transformers/models/siglip/modeling_siglip.py (SiglipVisionTransformer).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation


@dataclass
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

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
        activation(self.hidden_act)  # refuses an unknown one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        """From a SiglipVisionConfig dict (a vision_config)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        size = args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size, size, stride=size)
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, C, H, W] -> [N, hidden, H/p, W/p] -> [N, patches, hidden], patches row by row
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        # [N, T, dim] -> [N, heads, T, head_dim]
        q, k, v = (
            proj(x).view(batch, tokens, self.heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.act = activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = Attention(args)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)


class VisionModel(nn.Module):
    """Pixels [N, C, image_size, image_size] -> hidden states [N, patches, hidden], with
    HF's module names (SiglipVisionModel: vision_model.embeddings, ...)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionTransformer(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        body = self.vision_model
        x = body.embeddings(pixels)
        for layer in body.encoder.layers:
            x = layer(x)
        return body.post_layernorm(x)
