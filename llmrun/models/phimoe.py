"""Phi-3.5-MoE (PhimoeForCausalLM; llama.cpp's "phimoe" GGUFs): Mixtral's layout (16
experts of w1/w2/w3, two a token) with LayerNorms (weight and bias) for its norms,
biases on q/k/v/o and on lm_head, LongRoPE with an attention scale of its own
(short_mscale, long_mscale), and the sparsemixer's routing, at inference a fixed
function of the router's logits s (sparsemixer below):

  the first expert is argmax s, weighed by its softmax among the experts whose logit is
  within a relative 2 * router_jitter_noise of the best (|best - s_e| / max(|s_e|, best)
  <= 2 eps); the second is the argmax of the others, weighed by its softmax among them
  within the same margin of it. The weights are not renormalized.

Reference: transformers/models/phimoe/modeling_phimoe.py. Parameter names are the Hub's
checkpoint keys (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1`, ...).
LongRoPE: transformers' PhimoeRotaryEmbedding always takes the short factors and picks
the long mscale by the forward's length; llmrun takes long factors and long mscale
together, once the context outgrows original_max_position_embeddings (the original
Phi-3.5-MoE code's choice and llama.cpp's, judged by the cache's capacity as for Phi-3:
base.RotaryEmbedding); within the original context both are transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import llama, mixtral
from llmrun.models.base import CausalLM, Frame, args_from_config, mix_experts
from llmrun.models.base import RotaryEmbedding as BaseRotaryEmbedding
from llmrun.models.cache import KVCache

TOP_K = 2  # the sparsemixer picks two experts whatever num_experts_per_tok says


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5  # the LayerNorms' epsilon
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    attention_bias: bool = False
    lm_head_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_local_experts: int = 16
    num_experts_per_tok: int = TOP_K
    router_jitter_noise: float = 0.01
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_experts_per_tok != TOP_K:
            raise UnsupportedError(
                f"num_experts_per_tok is {self.num_experts_per_tok}; PhiMoE's sparsemixer "
                f"routes each token to {TOP_K} experts"
            )
        if self.num_local_experts < TOP_K:
            raise ModelFormatError(
                f"num_local_experts is {self.num_local_experts}; PhiMoE routes each token "
                f"to {TOP_K} experts"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class RotaryEmbedding(BaseRotaryEmbedding):
    """LongRoPE whose cos/sin are scaled by short_mscale, or by long_mscale where the long
    factors apply; without those (a GGUF's rope.scaling.attn_factor), base's scale."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        super().__init__(params, head_dim, max_position_embeddings)
        self.mscales = None
        if params.get("short_mscale") is not None and params.get("long_mscale") is not None:
            self.mscales = (float(params["short_mscale"]), float(params["long_mscale"]))
            self.attention_scaling = 1.0

    def _angles(
        self, positions: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._angles(positions, capacity)
        if self.mscales is None or self.long_inv_freq is None:
            return cos, sin
        short, long = self.mscales
        # The long factors' rule (base.RotaryEmbedding._angles): by the cache's capacity,
        # else per row.
        if capacity is not None:
            scale = long if capacity > self.original_max else short
            return cos * scale, sin * scale
        longer = positions.amax(dim=-1, keepdim=True) + 1 > self.original_max  # [B, 1]
        scale = torch.where(longer, long, short)[..., None].to(cos.dtype)  # [B, 1, 1]
        return cos * scale, sin * scale


def sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' sparsemixer at inference: the two experts of each token's router
    logits [N, E] and their weights, in f32 ([N, 2] each; see the module docstring)."""
    scores = logits.float()

    def choose(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, index = candidates.max(dim=-1, keepdim=True)
        # Experts further than the margin from the best (relative to the larger of their
        # logit's size and the best) are left out of the softmax.
        factor = scores.abs().clamp(min=best)
        kept = candidates.masked_fill((best - scores) / factor > 2 * jitter_eps, float("-inf"))
        return torch.softmax(kept, dim=-1).gather(-1, index), index

    first_weight, first = choose(scores)
    second_weight, second = choose(scores.scatter(-1, first, float("-inf")))
    return torch.cat((first_weight, second_weight), -1), torch.cat((first, second), -1)


class SparseMoeBlock(nn.Module):
    """Mixtral's experts, routed by the sparsemixer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.jitter_eps = TOP_K, args.router_jitter_noise
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = nn.ModuleList(mixtral.Expert(args) for _ in range(args.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = sparsemixer(self.gate(x2), self.jitter_eps)
        return mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    """x + attn(ln(x)), then x + block_sparse_moe(ln(x)), with LayerNorms."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.block_sparse_moe = mlp(args)
        self.input_layernorm = nn.LayerNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        norm = nn.LayerNorm(args.hidden_size, args.rms_norm_eps)
        super().__init__(args, llama.Attention, SparseMoeBlock, DecoderLayer, norm)
        self.model.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.lm_head_bias)
