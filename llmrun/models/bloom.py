"""BLOOM and BLOOMZ (BigScience; llama.cpp's "bloom" GGUFs): no positions in the
embedding but ALiBi's bias in attention (base.Alibi), a LayerNorm over the embeddings,
one fused query_key_value projection whose rows interleave each head's query, key and
value, biases everywhere, LayerNorms with a bias, and a GELU (tanh) feed-forward without
a gate. With apply_residual_connection_post_layernorm each residual is the normed input
rather than the input.

The checkpoints name the modules transformer.word_embeddings, transformer.h.N, ...
(bloom-560m and its siblings without the "transformer." prefix); the loader renames
them to llmrun's (llmrun/loading/alibi_families.py).

Reference: transformers/models/bloom/modeling_bloom.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import Alibi, CausalLM, Frame, alibi_slopes, attend_biased
from llmrun.models.cache import KVCache

# BloomConfig.attribute_map: the checkpoints' field names -> the usual ones.
CONFIG_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads"}


@dataclass
class ModelArgs:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    vocab_size: int = 250880
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048  # no limit of the model's own: a cache's default
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads

    def alibi_slopes(self) -> torch.Tensor:
        return alibi_slopes(self.num_attention_heads)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        if config.get("n_embed") is not None:  # BloomConfig's older name
            config.setdefault("hidden_size", config["n_embed"])
        names = set(cls.__dataclass_fields__) - {"rope_parameters"}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


class Attention(nn.Module):
    """query_key_value's rows per head (query, key, value), ALiBi-biased attention, dense."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, args.num_attention_heads, args.head_dim
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*3*D] -> [B, T, H, 3, D] -> 3 x [B, H, T, D]
        qkv = self.query_key_value(x).view(batch, tokens, self.n_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        return self.dense(attend_biased(q, k, v, self.layer, frame, cache, self.head_dim**-0.5))


class MLP(nn.Module):
    """dense_4h_to_h(gelu_tanh(dense_h_to_4h(x))), both biased."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, 4 * args.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(ops.gelu_tanh(self.dense_h_to_4h(x)))


class DecoderLayer(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)); each residual ln(x) instead of x with
    apply_residual_connection_post_layernorm."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.self_attention = attention(args, layer)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.mlp = mlp(args)
        self.post_layernorm_residual = args.apply_residual_connection_post_layernorm

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        x = (normed if self.post_layernorm_residual else x) + self.self_attention(
            normed, frame, cache
        )
        normed = self.post_attention_layernorm(x)
        return (normed if self.post_layernorm_residual else x) + self.mlp(normed)


class Body(nn.Module):
    """The embedding and its LayerNorm, the layers and the final LayerNorm (ln_f)."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)


class Model(Alibi, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP, DecoderLayer, body=Body)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings_layernorm(self.model.embed_tokens(input_ids))
