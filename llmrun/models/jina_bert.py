"""Jina BERT v2 (JinaBertModel: jina-embeddings-v2-small-en, -base-en, -base-de/es/zh,
-base-code; llama.cpp's "jina-bert-v2" GGUFs): BERT with symmetric ALiBi instead of a
position table and a GEGLU feed-forward. Token and token-type (0) embeddings summed and normalized, then
post-norm blocks x = LN(x + attn(x)), x = LN(x + wo(gelu(g) * u)), where gated_layers(x)
gives [g, u] (its first intermediate_size features the gate), and attention scores that
take -slope_h * |query - key| (ALiBi's slopes, every key before and after a query), padded
keys masked. Some variants normalize the queries and keys over the whole hidden width
(layer_norm_q, layer_norm_k) before splitting them into heads; jina-embeddings-v2-base-code
(jinaai/jina-bert-v2-qk-post-norm's modeling_bert.py) also adds the layer input to the
attention's output again and normalizes that (layer_norm_1) before the feed-forward. No
final norm and no head: an embedding model (`hidden_states`).

Module names are the Hub's (jinaai/jina-bert-implementation's modeling_bert.py):
embeddings., encoder.layer.N.attention.self.query, mlp.gated_layers, mlp.wo, mlp.layernorm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.base import activation, alibi_slopes
from llmrun.models.bert import Output
from llmrun.models.nomic_bert import Embeddings


@dataclass
class ModelArgs:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 8192
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    vocab_size: int = 30528
    # Whether queries and keys pass a LayerNorm, and whether the attention's output takes
    # the layer input and a LayerNorm again (set by the loader from the weights).
    qk_norm: bool = False
    attention_norm_2: bool = False

    def __post_init__(self) -> None:
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        hidden = args.hidden_size
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        norm = args.qk_norm
        self.layer_norm_q = nn.LayerNorm(hidden, args.layer_norm_eps) if norm else None
        self.layer_norm_k = nn.LayerNorm(hidden, args.layer_norm_eps) if norm else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k = self.query(x), self.key(x)
        if self.layer_norm_q is not None:
            q, k = self.layer_norm_q(q), self.layer_norm_k(k)

        def heads(t: torch.Tensor) -> torch.Tensor:
            # [B, T, H * D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(self.value(x)), bias)
        return out.transpose(1, 2).reshape(batch, tokens, -1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self = SelfAttention(args)
        self.output = Output(args, args.hidden_size)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, bias), x)


class GLUMLP(nn.Module):
    """LayerNorm(x + wo(act(gate) * up)), [gate, up] = gated_layers(x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.width = args.intermediate_size
        self.gated_layers = nn.Linear(args.hidden_size, 2 * self.width, bias=False)
        self.act = activation(args.hidden_act)
        self.wo = nn.Linear(self.width, args.hidden_size)
        self.layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.gated_layers(x)
        gate, up = both[..., : self.width], both[..., self.width :]
        return self.layernorm(x + self.wo(self.act(gate) * up))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        norm = args.attention_norm_2
        self.layer_norm_1 = nn.LayerNorm(args.hidden_size, args.layer_norm_eps) if norm else None
        self.mlp = GLUMLP(args)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = self.attention(x, bias)
        if self.layer_norm_1 is not None:
            out = self.layer_norm_1(out + x)
        return self.mlp(out)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


def alibi_bias(
    positions: torch.Tensor, lengths: torch.Tensor, slopes: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The attention's additive bias [B, H, T, T]: -slope_h * |query - key| for each row's
    first lengths[b] keys, -inf for the padding after them."""
    # [B, T] -> [B, 1, T, T]
    distance = (positions[:, None, :, None] - positions[:, None, None, :]).abs().float()
    bias = -slopes[None, :, None, None] * distance
    keys = torch.arange(positions.shape[1], device=positions.device)
    padded = (keys[None, :] >= lengths[:, None])[:, None, None, :]
    return bias.masked_fill(padded, float("-inf")).to(dtype)


class Model(nn.Module):
    """The encoder under JinaBertModel's module names (embeddings., encoder.layer.N.)."""

    generates = False  # no LM head: an embedding model (llmrun embed)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] of input_ids [B, T] at positions
        [B, T], each row's first lengths[b] tokens real (padding after them is never
        attended to)."""
        x = self.embeddings(input_ids)
        slopes = alibi_slopes(self.args.num_attention_heads).to(x.device)
        bias = alibi_bias(positions, lengths, slopes, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x.float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)
