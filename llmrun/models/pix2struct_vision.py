"""Pix2Struct's image encoder: an image's flattened patches [N, 2 + patch pixels] (each
row's 1-based row and column ids, then its pixels; llmrun.pix2struct_images makes them) ->
their states [N, hidden].

Each patch goes through a Linear, plus learned row and column embeddings of its ids; then
T5-style layers (RMS norms without a mean before attention and before the feed-forward;
attention without biases or score scaling, heads of d_kv; a gated feed-forward
wo(act(wi_0(x)) * wi_1(x))), and a final RMS norm. The patches see each other both ways;
the processor's padding patches are never made, so no mask is needed.

Reference: transformers/models/pix2struct/modeling_pix2struct.py (Pix2StructVisionModel,
Pix2StructVisionEmbeddings, Pix2StructVisionLayer, Pix2StructVisionAttention,
Pix2StructVisionMlp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import RMSNorm, activation


@dataclass
class VisionArgs:
    """Pix2StructVisionConfig's fields that shape the encoder (its names and defaults)."""

    hidden_size: int = 768
    patch_embed_hidden_size: int = 768
    d_ff: int = 2048
    d_kv: int = 64
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    dense_act_fn: str = "gelu_new"
    layer_norm_eps: float = 1e-6
    seq_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("hidden_size", "patch_embed_hidden_size", "d_kv", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"Pix2Struct vision {name} is {value!r}")
        activation(self.dense_act_fn)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionArgs:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.patch_projection = nn.Linear(args.patch_embed_hidden_size, args.hidden_size)
        self.row_embedder = nn.Embedding(args.seq_len, args.hidden_size)
        self.column_embedder = nn.Embedding(args.seq_len, args.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        rows, columns = patches[..., 0].long(), patches[..., 1].long()
        x = self.patch_projection(patches[..., 2:])
        return x + self.row_embedder(rows) + self.column_embedder(columns)


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.heads, inner = args.num_attention_heads, args.num_attention_heads * args.d_kv
        self.query = nn.Linear(args.hidden_size, inner, bias=False)
        self.key = nn.Linear(args.hidden_size, inner, bias=False)
        self.value = nn.Linear(args.hidden_size, inner, bias=False)
        self.output = nn.Linear(inner, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, T, H*D] -> [N, H, T, D]
            return t.view(batch, tokens, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.output(out.transpose(1, 2).reshape(batch, tokens, -1))


class Mlp(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(args.hidden_size, args.d_ff, bias=False)
        self.wi_1 = nn.Linear(args.hidden_size, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.hidden_size, bias=False)
        self.act = activation(args.dense_act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))


class Layer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.mlp = Mlp(args)
        self.pre_attention_layer_norm = RMSNorm(args.hidden_size, args.layer_norm_eps)
        self.pre_mlp_layer_norm = RMSNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.pre_attention_layer_norm(x))
        return x + self.mlp(self.pre_mlp_layer_norm(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class VisionModel(nn.Module):
    """Pix2StructVisionModel under its names (embeddings, encoder.layer.N, layernorm)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.layernorm = RMSNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, T, 2 + pixels] -> states [N, T, hidden]."""
        x = self.embeddings(patches)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)
