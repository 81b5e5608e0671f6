"""GroveMoE (inclusionAI/GroveMoE-Base and -Inst): Qwen3-MoE with adjugate experts. The
experts form groups of experts_per_group; each group has a small adjugate expert
(chunk_experts) that runs on the token beside every chosen expert of its group, with
that expert's weight, and whose sum is scaled by expert_group_scale. The router picks by
sigmoid and weighs by softmax (the same order), renormalized over the top-k.

Reference: the Hub's remote code (modeling_grove_moe.py GroveMoeSparseMoeBlock, whose
group size, adjugate width and scale are constants: 2, 128, 0.05). llama.cpp's
src/models/grovemoe.cpp differs in two places: its adjugate experts read the routed
experts' output rather than the layer's input, and weigh chosen expert e by the
probability of expert e // experts_per_group (tests/models/test_grovemoe.py). Parameter
names are the Hub's checkpoint keys (mlp.experts.N, mlp.chunk_experts.N, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import qwen3_moe
from llmrun.models.base import CausalLM, mix_experts, route
from llmrun.models.qwen2_moe import MLP, DecoderLayer
from llmrun.models.qwen3 import Attention


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    experts_per_group: int = 2
    chunk_intermediate_size: int = 128  # each adjugate expert's width
    expert_group_scale: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts_per_group < 1 or self.num_experts % self.experts_per_group:
            raise ModelFormatError(
                f"GroveMoE's {self.num_experts} experts do not form groups of "
                f"{self.experts_per_group}"
            )


class SparseMoeBlock(nn.Module):
    """The top-k experts of the router plus, beside each, its group's adjugate expert
    (scaled by expert_group_scale), on the same input with the same weight."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.group = args.num_experts_per_tok, args.experts_per_group
        self.scale = args.expert_group_scale
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.chunk_experts = nn.ModuleList(
            MLP(args, args.chunk_intermediate_size)
            for _ in range(args.num_experts // args.experts_per_group)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = route(self.gate(flat), self.top_k, True)
        routed = mix_experts(flat, weights, indices, self.experts)
        adjugate = mix_experts(flat, weights, indices // self.group, self.chunk_experts)
        return (routed + self.scale * adjugate).view(x.shape)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)
