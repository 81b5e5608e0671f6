"""IBM Granite 3.0/3.1 MoE (GraniteMoeForCausalLM: 1B-A400M, 3B-A800M) and its
shared-expert variant (GraniteMoeSharedForCausalLM); llama.cpp writes both as
"granitemoe" GGUFs. Granite (granite.py: the embedding, residual, attention and logit
multipliers) with a mixture-of-experts feed-forward: the top-k experts of a softmax
router, renormalized, plus an always-on shared expert where shared_intermediate_size
is set.

Reference: transformers/models/granitemoe/modeling_granitemoe.py and
granitemoeshared/modeling_granitemoeshared.py. The Hub's checkpoints hold each layer's
experts fused (block_sparse_moe.input_linear [E, 2I, D]: gate rows, then up rows;
output_linear [E, D, I]; shared_mlp.input_linear likewise); llmrun keeps one module per
expert under the names its other MoE families use (mlp.gate, mlp.experts.N.gate_proj,
mlp.shared_expert.up_proj, ...), and llmrun/loading/granite.py splits the fused tensors
into them, as llama.cpp's converter splits them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.models import granite
from llmrun.models.base import GatedMLP, args_from_config, check_top_k, mix_experts, route


@dataclass
class ModelArgs(granite.ModelArgs):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    shared_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        super().__post_init__()
        check_top_k(self.num_experts_per_tok, self.num_local_experts, "num_local_experts")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router's logits, weighted by the softmax of those k
    logits (the router's softmax renormalized over the top k: the same weights), plus the
    shared expert; the sum scaled by residual_multiplier."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.residual_multiplier = args.num_experts_per_tok, args.residual_multiplier
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        # Experts intermediate_size wide, without biases.
        expert = dataclasses.replace(args, mlp_bias=False)
        self.experts = nn.ModuleList(GatedMLP(expert) for _ in range(args.num_local_experts))
        self.shared_expert = None
        if args.shared_intermediate_size:
            shared = dataclasses.replace(expert, intermediate_size=args.shared_intermediate_size)
            self.shared_expert = GatedMLP(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.gate(x2), self.top_k, normalize=True)
        out = mix_experts(x2, weights, indices, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        return (out * self.residual_multiplier).view(x.shape)


class Model(granite.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, SparseMoeBlock)
