"""Flint (RecursiveSI/flint, FlintForCausalLM): Qwen3-MoE's attention (an RMSNorm on each
query and key head) with gpt-oss's attention sinks (a learned logit per head in every
softmax's denominator, the Hub's `self_attn.softmax_offset`), sliding-window and full
layers as `layer_types` says, RoPE on the sliding layers alone (the full ones have no
position encoding); dense feed-forwards in `mlp_only_layers`, elsewhere the top-k of many
small experts by sigmoid scores (renormalized where norm_topk_prob) plus one shared
expert added whole, without a gate.

Reference: transformers/models/flint/modular_flint.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.models import qwen3_moe
from llmrun.models.base import (
    CausalLM,
    Frame,
    LayerTypes,
    args_from_config,
    mix_experts,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache
from llmrun.models.gpt_oss import attend_with_sinks
from llmrun.models.qwen3_moe import MLP


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    # FlintConfig's defaults where they differ from Qwen3-MoE's.
    intermediate_size: int = 6144
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = True
    head_dim: int | None = 128
    max_position_embeddings: int = 262144
    sliding_window: int | None = 513
    layer_types: list[str] | None = None
    mlp_only_layers: list[int] = field(default_factory=lambda: [0, 1])

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            # FlintConfig: full attention in the first two layers, every fourth from
            # layer 1 and the last; sliding elsewhere.
            last = self.num_hidden_layers - 1
            self.layer_types = [
                "full_attention" if i < 2 or i % 4 == 1 or i == last else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = windowed_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # FlintConfig has no use_sliding_window (its windows are the layer types').
        config = {k: v for k, v in config.items() if k != "use_sliding_window"}
        return args_from_config(cls, config, nullable=("sliding_window",))

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(qwen3_moe.Attention):
    """Qwen3-MoE's projections and q/k norms; its layer type's frame, RoPE on the
    sliding layers alone, and the sinks in the softmax."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]
        self.rotary = self.layer_type == "sliding_attention"
        self.scale = args.head_dim**-0.5
        self.softmax_offset = nn.Parameter(torch.zeros(self.n_heads))  # the sinks

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = frame.rotate(q), frame.rotate(k)
        out = attend_with_sinks(q, k, v, self.layer, frame, cache, self.scale, self.softmax_offset)
        return self.o_proj(out)


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's sigmoid scores (f32), renormalized where
    norm_topk_prob, plus the shared expert, whole."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.shared_expert = MLP(args, args.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        scores = torch.sigmoid(nn.functional.linear(x2.float(), self.gate.weight.float()))
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = mix_experts(x2, weights.to(x2.dtype), indices, self.experts)
        return (routed + self.shared_expert(x2)).view(x.shape)


class Model(LayerTypes, CausalLM):
    """CausalLM with the Hub checkpoint's module names (one module per expert, as the
    Hub's files hold them), a Frame per layer type."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, qwen3_moe.DecoderLayer)
