"""Grok (xai-org's Grok-1 and Grok-2): a mixture of experts (Mixtral's top-k of a
softmax, renormalized) whose experts are tanh-GELU gated, with an RMSNorm after attention
and after the feed-forward too, muP-style multipliers (the embeddings times
embedding_multiplier_scale, the logits times output_multiplier_scale), attention scores
times attn_output_multiplier (no 1/sqrt(head_dim)) soft-capped by attn_logit_softcapping,
and, in Grok-2, a dense feed-forward beside the experts (residual_moe: their mean
times sqrt(2)) and soft-capped logits.

Reference: llama.cpp's src/models/grok.cpp (no transformers class: the Hub's folders hold
xAI's own or remote code). Parameter names are Grok-2's checkpoint keys (pre_attn_norm,
block_sparse_moe.experts.N.w1, post_moe_norm, ...). As llama.cpp, llmrun leaves the
router's logits uncapped (router_logit_softcapping is not read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    GatedMLP,
    RMSNorm,
    TopKExperts,
    args_from_config,
    attend_scaled,
    check_top_k,
)
from llmrun.models.cache import KVCache
from llmrun.models.mixtral import Attention as MixtralAttention
from llmrun.models.mixtral import Expert


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # the dense feed-forward's, and Grok-1's experts'
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    moe_intermediate_size: int | None = None  # each expert's (Grok-2)
    residual_moe: bool = False  # a dense feed-forward beside the experts (Grok-2)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    hidden_act: str = "gelu_pytorch_tanh"
    # Grok-1's values, llama.cpp's defaults (llama_model_grok::load_arch_hparams).
    embedding_multiplier_scale: float = 78.38367176906169
    output_multiplier_scale: float = 0.5773502691896257
    attn_output_multiplier: float | None = None  # head_dim ** -0.5 where absent
    attn_logit_softcapping: float = 30.0
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
        self.final_logit_softcapping = self.final_logit_softcapping or None  # 0: none
        if self.attn_output_multiplier is None:
            self.attn_output_multiplier = self.head_dim**-0.5
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("rope_type") in ("yarn", "original"):  # Grok-2's, top level
            raise UnsupportedError(f"Grok with rope_type {config['rope_type']!r} is not supported")
        # Grok's configs name no activation: its experts and dense feed-forward are tanh-GELU.
        config = {k: v for k, v in config.items() if k != "hidden_act"}
        return args_from_config(cls, config, nullable=("final_logit_softcapping",))


class Attention(MixtralAttention):
    """Mixtral's projections; scores q.k * attn_output_multiplier, soft-capped."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.scale, self.softcap = args.attn_output_multiplier, args.attn_logit_softcapping

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k)
        out = attend_scaled(q, k, v, self.layer, frame, cache, self.scale, self.softcap)
        return self.o_proj(out)


class SparseMoeBlock(TopKExperts):
    """The top-k experts (moe_intermediate_size wide) of the router's softmax, their
    weights renormalized."""

    def __init__(self, args: ModelArgs) -> None:
        expert_args = replace(args, intermediate_size=args.moe_intermediate_size)
        super().__init__(args, args.num_local_experts, lambda: Expert(expert_args), True)


class DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(pre_attn_norm(x))), then x + post_moe_norm(ffn(
    pre_moe_norm(x))), ffn the experts, or with residual_moe (experts + dense) / sqrt(2)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, moe: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.block_sparse_moe = moe(args)
        self.mlp = GatedMLP(args) if args.residual_moe else None
        eps = args.rms_norm_eps
        self.pre_attn_norm = RMSNorm(args.hidden_size, eps)
        self.post_attn_norm = RMSNorm(args.hidden_size, eps)
        self.pre_moe_norm = RMSNorm(args.hidden_size, eps)
        self.post_moe_norm = RMSNorm(args.hidden_size, eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.post_attn_norm(self.self_attn(self.pre_attn_norm(x), frame, cache))
        h = self.pre_moe_norm(x)
        out = self.block_sparse_moe(h)
        if self.mlp is not None:
            out = (self.mlp(h) + out) * (math.sqrt(2) / 2)
        return x + self.post_moe_norm(out)


class Model(CausalLM):
    """embed * embedding_multiplier_scale -> layers -> norm -> lm_head *
    output_multiplier_scale (-> soft-cap)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits, as CausalLM.forward's, scaled and soft-capped."""
        logits = super().forward(input_ids, positions, cache, last_only, last, static)
        logits = logits * self.args.output_multiplier_scale
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.args.embedding_multiplier_scale
