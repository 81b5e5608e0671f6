"""MiniMax-M2 (M2, M2.1, M2.5; llama.cpp's "minimax-m2" GGUFs): grouped-query attention
whose queries and keys are RMS-normalized over the whole projection (all heads together,
before they are split, unlike Qwen3's per-head norms), RoPE on the first rotary_dim
features of each head (halves rotated), and in every layer a mixture of experts without
a shared expert: sigmoid scores, the top-k chosen by score + e_score_correction_bias,
weighted by their unbiased scores renormalized to sum to 1.

The released config.json carries switches from MiniMax's own code (use_qk_norm,
qk_norm_type, scoring_func, use_routing_bias, shared_intermediate_size, attn_type_list,
...); transformers computes one setting of them, the released one, and llmrun refuses a
config that asks for another.

Reference: transformers/models/minimax_m2/modeling_minimax_m2.py. Parameter names are the
Hub's checkpoint keys (`block_sparse_moe.experts.N.w1`, `block_sparse_moe.gate`,
`block_sparse_moe.e_score_correction_bias`), one module per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    RMSNorm,
    args_from_config,
    attend,
    check_top_k,
    mix_experts,
    route_grouped,
)
from llmrun.models.cache import KVCache
from llmrun.models.mixtral import Expert

ROPE_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta
# The switches of MiniMax's config.json and the one value of each that transformers
# computes (it reads none of them).
RELEASED = {
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "shared_intermediate_size": 0,
    "routed_scaling_factor": 1.0,
    "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_beta": 1.0,
    "layernorm_mlp_beta": 1.0,
}
FULL_ATTENTION = 1  # attn_type_list: 1 softmax attention, 0 MiniMax-01's lightning attention


@dataclass
class ModelArgs:
    # MiniMaxM2Config's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 1536  # each expert's
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 196608
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        check_switches(config)
        config = {"rope_theta": ROPE_THETA, **config}
        if config.get("rotary_dim") is not None and "partial_rotary_factor" not in config:
            # transformers' MiniMaxM2Config turns rotary_dim into this.
            head_dim = config.get("head_dim") or cls.head_dim
            config["partial_rotary_factor"] = config["rotary_dim"] / head_dim
        if "num_local_experts" not in config and "num_experts" in config:
            config["num_local_experts"] = config["num_experts"]
        return args_from_config(cls, config)


def check_switches(config: dict[str, Any]) -> None:
    """Refuse a config.json whose MiniMax switches ask for what transformers (and llmrun)
    do not compute: each of RELEASED at another value, layers of lightning attention,
    grouped routing, a sliding window."""
    for name, released in RELEASED.items():
        value = config.get(name)
        if value is not None and value != released:
            raise UnsupportedError(
                f"MiniMax-M2 with {name}={value!r} is not supported (llmrun computes "
                f"{name}={released!r}, as the released models and transformers do)"
            )
    kinds = config.get("attn_type_list")
    if kinds is not None and any(kind != FULL_ATTENTION for kind in kinds):
        raise UnsupportedError(
            "MiniMax-M2 with lightning-attention layers (0 in attn_type_list) is not supported"
        )
    if (config.get("num_expert_group") or 1) > 1:
        raise UnsupportedError("MiniMax-M2 with grouped expert routing is not supported")
    for name in ("sliding_window", "attn_window_size"):
        if config.get(name):
            raise UnsupportedError(f"MiniMax-M2 with a {name} is not supported")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = (
            layer,
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        self.head_dim = args.head_dim
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        # Over the whole projection: one RMS for all heads of a token.
        self.q_norm = RMSNorm(q_width, args.rms_norm_eps)
        self.k_norm = RMSNorm(kv_width, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] normalized, then -> [B, H, T, D]
        q = self.q_norm(self.q_proj(x)).view(batch, tokens, self.n_heads, -1).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(batch, tokens, self.n_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, -1).transpose(1, 2)
        return self.o_proj(attend(frame.rotate(q), frame.rotate(k), v, self.layer, frame, cache))


class SparseMoeBlock(nn.Module):
    """Each token through the top-k experts by sigmoid score + selection bias, weighted
    by their unbiased scores, renormalized."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.num_local_experts))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        logits = nn.functional.linear(x2.float(), self.gate.weight.float())
        bias = self.e_score_correction_bias.float()
        weights, indices = route_grouped(logits, self.top_k, "sigmoid", bias, normalize=True)
        return mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)


class DecoderLayer(nn.Module):
    """base.DecoderLayer with the experts under the Hub's name, block_sparse_moe."""

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
