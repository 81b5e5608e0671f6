"""StableLM (StableLM-3B-4E1T, StableLM 2 1.6B and 12B, Zephyr; llama.cpp's "stablelm"
GGUFs): Llama's SwiGLU feed-forward and grouped-query attention with LayerNorms (weight
and bias) for its norms, RoPE on the first partial_rotary_factor of each head's
features (a quarter by default), optional biases on q/k/v (never on the output
projection), optional per-head LayerNorms without bias on the queries and keys
(qk_layernorm, StableLM 2 12B), and an optional parallel block (use_parallel_residual:
attention and feed-forward both read the input's one norm, StableLM 2 12B).

Reference: transformers/models/stablelm/modeling_stablelm.py. Parameter names are the
Hub's checkpoint keys (the per-head norms as `q_layernorm.norms.N.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.models.base import CausalLM, Frame, GatedMLP, args_from_config, attend
from llmrun.models.cache import KVCache

# StableLmConfig's partial_rotary_factor where a config gives none.
DEFAULT_ROTARY_FACTOR = 0.25


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    qk_layernorm: bool = False
    use_parallel_residual: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        # transformers' StableLM splits the hidden size into its heads, whatever head_dim says.
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_parameters.setdefault("partial_rotary_factor", DEFAULT_ROTARY_FACTOR)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class HeadNorms(nn.Module):
    """A LayerNorm without bias over each head's features, with each head's own scale
    (transformers' StableLmLayerNormPerHead), for x [B, H, T, D]."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps, bias=False) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [H, D] -> [H, 1, D], broadcast over the batch and the tokens
        scales = torch.stack([norm.weight for norm in self.norms])[:, None]
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * scales


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        bias = args.use_qkv_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.qk_layernorm = args.qk_layernorm
        if self.qk_layernorm:
            eps = args.layer_norm_eps
            self.q_layernorm = HeadNorms(self.n_heads, self.head_dim, eps)
            self.k_layernorm = HeadNorms(self.n_kv_heads, self.head_dim, eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = frame.rotate(q), frame.rotate(k)  # the first rotary_dim features of each head
        return self.o_proj(attend(q, k, v, self.layer, frame, cache))


class DecoderLayer(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln2(x)); or, with use_parallel_residual,
    x + attn(ln(x)) + mlp(ln(x)) (no second norm)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.parallel = args.use_parallel_residual
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attended = self.self_attn(normed, frame, cache)
        if self.parallel:
            return x + attended + self.mlp(normed)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        super().__init__(args, Attention, GatedMLP, DecoderLayer, norm)
