"""ViT and DeiT image encoders as transformers' ViTModel and DeiTModel run them without a
pooler (VisionEncoderDecoderModel's encoder: TrOCR's): patches through a strided
convolution, a class token (and DeiT's distillation token) in front, learned absolute
positions, pre-norm layers (layernorm_before, attention, layernorm_after, a GELU MLP), a
final LayerNorm. Pixels [B, 3, S, S] -> [B, tokens, hidden_size], every token kept.

Reference: transformers/models/vit/modeling_vit.py (ViTEmbeddings, ViTLayer, ViTModel),
models/deit/modeling_deit.py (DeiTEmbeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation

MODEL_TYPES = ("vit", "deit")


@dataclass(frozen=True)
class VitArgs:
    """ViTConfig's (DeiTConfig's) fields, by its names; `model_type` says which."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    model_type: str = "vit"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VitArgs:
        """From a ViTConfig's or DeiTConfig's dict (the class's defaults where it has none)."""
        fields = {k: config[k] for k in cls.__dataclass_fields__ if config.get(k) is not None}
        args = cls(**fields)
        ints = ("hidden_size", "num_attention_heads", "image_size", "patch_size")
        for name in ints:
            value = getattr(args, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"the encoder's {name} is {value!r}")
        if args.hidden_size % args.num_attention_heads or args.image_size % args.patch_size:
            raise ModelFormatError(
                "the encoder's hidden_size is not a multiple of its heads, or its image_size "
                "of its patch_size"
            )
        activation(args.hidden_act)
        return args

    @property
    def tokens(self) -> int:
        """The encoder's output tokens: the patches and the class (and distillation) token."""
        extra = 2 if self.model_type == "deit" else 1
        return (self.image_size // self.patch_size) ** 2 + extra


class PatchEmbeddings(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.projection = nn.Conv2d(
            args.num_channels, args.hidden_size, args.patch_size, args.patch_size
        )


class Embeddings(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, args.hidden_size))
        if args.model_type == "deit":
            self.distillation_token = nn.Parameter(torch.zeros(1, 1, args.hidden_size))
        self.patch_embeddings = PatchEmbeddings(args)
        self.position_embeddings = nn.Parameter(torch.zeros(1, args.tokens, args.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [B, 3, S, S] -> [B, patches, hidden]
        patches = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        first = [self.cls_token]
        if hasattr(self, "distillation_token"):
            first.append(self.distillation_token)
        b = patches.shape[0]
        x = torch.cat([t.expand(b, -1, -1) for t in first] + [patches], dim=1)
        return x + self.position_embeddings


class SelfAttention(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        self.query = nn.Linear(dim, dim, bias=args.qkv_bias)
        self.key = nn.Linear(dim, dim, bias=args.qkv_bias)
        self.value = nn.Linear(dim, dim, bias=args.qkv_bias)


class Dense(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, width_out)


class Attention(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.attention = SelfAttention(args)
        self.output = Dense(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        attn = self.attention

        def split(t: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, heads, N, D/heads]
            return t.view(b, n, attn.heads, d // attn.heads).transpose(1, 2)

        q, k, v = split(attn.query(x)), split(attn.key(x)), split(attn.value(x))
        out = F.scaled_dot_product_attention(q, k, v)  # scale (D/heads) ** -0.5
        return self.output.dense(out.transpose(1, 2).reshape(b, n, d))


class Layer(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Dense(args.hidden_size, args.intermediate_size)
        self.output = Dense(args.intermediate_size, args.hidden_size)
        self.layernorm_before = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.layernorm_before(x))
        return x + self.output.dense(self.act(self.intermediate.dense(self.layernorm_after(x))))


class Encoder(nn.Module):
    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class VitModel(nn.Module):
    """ViTModel (DeiTModel) under its names (embeddings.*, encoder.layer.N.*, layernorm.*)."""

    def __init__(self, args: VitArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The last hidden state [B, tokens, hidden_size] of pixels [B, 3, S, S]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)
