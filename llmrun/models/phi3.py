"""Phi-3 and Phi-3.5: fused qkv_proj and gate_up_proj, LongRoPE, partial rotary.

Reference: transformers/models/phi3/modeling_phi3.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.models.base import CausalLM, Frame, activation, args_from_config, attend
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

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
        qkv_size = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        # [B, T, H*D] -> [B, H, T, D]
        q = q.reshape(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(ops.gated(self.act, gate, up))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, MLP)
