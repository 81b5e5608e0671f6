"""LFM2-MoE (Liquid AI's LFM2-8B-A1B): LFM2's convolution and attention layers, whose
feed-forward is, after num_dense_layers dense ones, a mixture of experts. The router
scores each expert by the sigmoid of its logit, chooses the top num_experts_per_tok by
score + expert_bias (use_expert_bias), and weighs each chosen expert by its unbiased
score, renormalized over the chosen (norm_topk_prob), times routed_scaling_factor.

Reference: transformers/models/lfm2_moe/modeling_lfm2_moe.py. Parameter names are the
Hub's per-expert checkpoint keys (`feed_forward.experts.N.w1`, ...), which transformers
5 fuses when it loads them; llmrun keeps one module per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.models import lfm2
from llmrun.models.base import args_from_config, check_top_k, mix_experts, route_grouped


@dataclass
class ModelArgs(lfm2.ModelArgs):
    moe_intermediate_size: int = 1792
    num_experts: int = 32
    num_experts_per_tok: int = 4
    num_dense_layers: int = 2
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Lfm2MoeConfig has no width adjustment: the dense layers are intermediate_size wide.
    block_auto_adjust_ff_dim: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {**config, "block_auto_adjust_ff_dim": False}
        if "tie_embedding" in config:
            config["tie_word_embeddings"] = config["tie_embedding"]
        return args_from_config(cls, config)


class SparseMoeBlock(nn.Module):
    """The experts the router chooses (see the module docstring), weighted."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.scale = args.routed_scaling_factor
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            lfm2.MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        if args.use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route_grouped(
            self.gate(x2),
            self.top_k,
            scoring="sigmoid",
            bias=self.expert_bias,
            normalize=self.normalize,
            scale=self.scale,
        )
        return mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    """The first num_dense_layers layers' dense SwiGLU, the others' experts."""
    if layer < args.num_dense_layers:
        return lfm2.MLP(args, args.intermediate_size)
    return SparseMoeBlock(args)


class Model(lfm2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, feed_forward)
