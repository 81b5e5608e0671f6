"""OLMo 2 (AllenAI, 1B to 32B): Llama with its norms after each sublayer instead of
before it (x + norm(attn(x)), x + norm(mlp(x))), and an RMSNorm over each whole query
and key projection, all heads together, before the heads are split and rotated.

Reference: transformers/models/olmo2/modeling_olmo2.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models.base import CausalLM, Frame, GatedMLP, RMSNorm, args_from_config, attend
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
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
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
        bias = args.attention_bias
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(q_width, args.rms_norm_eps)
        self.k_norm = RMSNorm(kv_width, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # Normalized over all heads at once, then [B, T, H*D] -> [B, H, T, D]
        q = self.q_norm(self.q_proj(x)).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        return self.o_proj(self.attend(q, k, v, frame, cache))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        """Attention of the rotated q [B, H, T, D] to the keys and values: [B, T, H*D]."""
        return attend(q, k, v, self.layer, frame, cache)


class DecoderLayer(nn.Module):
    """x + post_norm(attn(x)), then x + post_ffw_norm(mlp(x)): no norm before either."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Any, cache: KVCache | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, frame, cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs, attention: type = Attention) -> None:
        super().__init__(args, attention, GatedMLP, DecoderLayer)
