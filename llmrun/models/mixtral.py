"""Mixtral: Mistral with a sparse mixture-of-experts feed-forward, top-2 of 8 experts.

Reference: transformers/models/mixtral/modeling_mixtral.py. Parameter names are the
Hub's per-expert checkpoint keys (`block_sparse_moe.experts.N.w1`, ...), which
transformers 5 fuses into 3-D tensors when it loads them; llmrun keeps one module
per expert, so a loader can hand it any expert's weights as they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import (
    CausalLM,
    Frame,
    RMSNorm,
    TopKExperts,
    activation,
    args_from_config,
    attend,
    check_top_k,
)
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class Expert(nn.Module):
    """w2(act(w1(x)) * w3(x)): w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.gated(self.act, self.w1(x), self.w3(x)))


class SparseMoeBlock(TopKExperts):
    """Each token through the top-k experts of its router's softmax, weighted by their
    renormalized probabilities."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, args.num_local_experts, lambda: Expert(args), norm_topk_prob=True)


class DecoderLayer(nn.Module):
    """Pre-norm residual block (base.DecoderLayer's), the experts named as the Hub's
    checkpoints name them (`block_sparse_moe`)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.block_sparse_moe = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)
