"""Falcon-7B, -40B and -180B, Falcon 2 11B and Falcon-RW without ALiBi (TII; llama.cpp's
"falcon" GGUFs): RoPE (half-split) on whole heads, one fused query_key_value projection,
LayerNorms with a bias, an exact-GELU feed-forward without a gate (ffn_hidden_size), and
biases on the projections only where `bias` is set. Three layouts of the fused rows and
blocks, as the config picks them:
- new_decoder_architecture (40B, 180B, 11B): num_kv_heads groups, each its queries then
  one key and one value; attention and feed-forward in parallel, reading one LayerNorm
  (num_ln_in_parallel_attn 1) or one each, ln_attn and ln_mlp (2, the default);
- multi_query (7B): all queries, then one key and one value; parallel_attn reads one
  LayerNorm for both, else (the sequential block) a second before the feed-forward;
- neither: each head's query, key and value together.
All three are KV groups of queries, a key and a value: num_kv_heads groups, one, or one
per head.
Falcon's ALiBi variant (alibi: true) is refused: transformers scales its bias with the
scores and rounds the slopes to bfloat16, which nothing else here follows.

The checkpoints name the modules transformer.word_embeddings, transformer.h.N and
transformer.ln_f; the loader renames them to llmrun's (llmrun/loading/falcon.py).

Reference: transformers/models/falcon/modeling_falcon.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import CausalLM, Frame, activation, args_from_config, attend
from llmrun.models.cache import KVCache

# FalconConfig.attribute_map: the checkpoints' older field names -> the usual ones.
CONFIG_ALIASES = {
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_head_kv": "num_kv_heads",
}


@dataclass
class ModelArgs:
    vocab_size: int = 65024
    hidden_size: int = 4544
    num_hidden_layers: int = 32
    num_attention_heads: int = 71
    num_kv_heads: int | None = None
    layer_norm_epsilon: float = 1e-5
    multi_query: bool = True
    new_decoder_architecture: bool = False
    parallel_attn: bool = True
    num_ln_in_parallel_attn: int | None = None
    bias: bool = False
    alibi: bool = False
    ffn_hidden_size: int | None = None
    activation: str = "gelu"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.alibi:
            raise UnsupportedError(
                "a Falcon model with ALiBi (alibi: true) is not supported; Falcon's RoPE models are"
            )
        if self.new_decoder_architecture and not self.parallel_attn:
            raise UnsupportedError(
                "a Falcon model of the new decoder architecture without parallel_attn is "
                "not supported (transformers cannot run it either)"
            )
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.ffn_hidden_size = self.ffn_hidden_size or 4 * self.hidden_size
        self.num_kv_heads = self.num_kv_heads or self.num_attention_heads
        if self.new_decoder_architecture:
            self.num_key_value_heads = self.num_kv_heads
            self.num_ln_in_parallel_attn = self.num_ln_in_parallel_attn or 2
        else:
            self.num_key_value_heads = 1 if self.multi_query else self.num_attention_heads
            self.num_ln_in_parallel_attn = 1

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for alias, name in CONFIG_ALIASES.items():
            if alias in config:
                config.setdefault(name, config.pop(alias))
        return args_from_config(cls, config)


class Attention(nn.Module):
    """query_key_value split into KV groups (every layout is one: see the module's note),
    RoPE, attention, dense."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads = layer, args.num_attention_heads
        self.n_kv_heads, self.head_dim = args.num_key_value_heads, args.head_dim
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(args.hidden_size, rows, bias=args.bias)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size, bias=args.bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, Hkv, H/Hkv + 2, D]: each KV group's queries, then its key and value
        # (multi-query: one group; neither layout: a group per head).
        groups = self.query_key_value(x).view(batch, tokens, self.n_kv_heads, -1, self.head_dim)
        q = groups[:, :, :, :-2].flatten(2, 3)
        k, v = groups[:, :, :, -2], groups[:, :, :, -1]
        # [B, T, H, D] -> [B, H, T, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.dense(attend(q, k, v, self.layer, frame, cache))


class MLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x)))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(args.hidden_size, args.ffn_hidden_size, bias=args.bias)
        self.dense_4h_to_h = nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=args.bias)
        self.act = activation(args.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class DecoderLayer(nn.Module):
    """Parallel: x + attn(ln(x)) + mlp(ln'(x)), ln' = ln, or ln_attn and ln_mlp with two
    LayerNorms. Sequential: x + attn(ln(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        eps = args.layer_norm_epsilon
        self.two_norms = args.num_ln_in_parallel_attn == 2
        self.parallel = args.parallel_attn
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(args.hidden_size, eps)
            self.ln_mlp = nn.LayerNorm(args.hidden_size, eps)
        else:
            self.input_layernorm = nn.LayerNorm(args.hidden_size, eps)
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps)
        self.self_attention = attention(args, layer)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        attn = self.self_attention(attn_in, frame, cache)
        if self.parallel:
            return x + self.mlp(mlp_in) + attn
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_epsilon)
        super().__init__(args, Attention, MLP, DecoderLayer, norm)
