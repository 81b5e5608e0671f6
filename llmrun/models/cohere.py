"""Cohere Command-R (Command-R 35B, Command R+, Aya 23, Aya Expanse; llama.cpp's
"command-r" GGUFs): Llama's attention and SwiGLU feed-forward in a parallel block
(both read one LayerNorm of the input and both add to the residual), LayerNorms
without bias, RoPE on adjacent pairs of features, optional per-head LayerNorms on the
queries and keys (use_qk_norm, Command R+), and logits multiplied by logit_scale.

Reference: transformers/models/cohere/modeling_cohere.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    args_from_config,
    attend,
    rotate_pairs,
)
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
    layer_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    logit_scale: float = 0.0625
    use_qk_norm: bool = False
    rotary_pct: float = 1.0
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    # transformers' CohereConfig.default_theta: the RoPE base of a config that gives none.
    default_theta: ClassVar[float] = 500000.0

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        # transformers rotates every feature whatever these say, llama.cpp only the
        # first rotary_pct of them: a partial rotation has no one meaning to follow.
        partial = self.rope_parameters.get("partial_rotary_factor", 1.0)
        if self.rotary_pct != 1.0 or partial != 1.0:
            raise UnsupportedError(
                f"a Cohere model with partial RoPE (rotary_pct {self.rotary_pct}, "
                f"partial_rotary_factor {partial}) is not supported"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in config and "rope_theta" not in params:
            config = {**config, "rope_theta": cls.default_theta}
        return args_from_config(cls, config)


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * weight over the last dimension, without a
    bias, computed in float32 and cast back (transformers' CohereLayerNorm). `shape`
    [heads, head_dim] gives each head its own scale (the q/k norms)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (normed * self.weight.float()).type_as(x)


class Attention(nn.Module):
    rotary = True  # Cohere 2's global layers turn RoPE off

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.use_qk_norm = args.use_qk_norm
        if self.use_qk_norm:
            eps = args.layer_norm_eps
            self.q_norm = LayerNorm((self.n_heads, self.head_dim), eps)
            self.k_norm = LayerNorm((self.n_kv_heads, self.head_dim), eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # [B, T, H, D] -> [B, H, T, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rotary:
            q, k = rotate_pairs(q, frame), rotate_pairs(k, frame)
        return self.o_proj(self.attend(q, k, v, frame, cache))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        """Attention over the cache, [B, T, H*D] (Cohere 2's windowed layers differ)."""
        return attend(q, k, v, self.layer, frame, cache)


class DecoderLayer(nn.Module):
    """The parallel block: x + attn(norm(x)) + mlp(norm(x))."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor, frame: Any, cache: KVCache | None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        return x + self.self_attn(normed, frame, cache) + self.mlp(normed)


class Model(CausalLM):
    """CausalLM's frames, cache and static decode step over Cohere's body, its logits
    times logit_scale."""

    def __init__(self, args: ModelArgs) -> None:
        norm = LayerNorm(args.hidden_size, args.layer_norm_eps)
        super().__init__(args, Attention, GatedMLP, DecoderLayer, norm)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits, as CausalLM.forward's, scaled."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static)
        return logits * self.args.logit_scale
