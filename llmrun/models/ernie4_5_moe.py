"""ERNIE 4.5 with experts (ERNIE-4.5-21B-A3B; llama.cpp's "ernie4_5-moe" GGUFs): ERNIE
4.5's attention, and in the layers that moe_layer_start_index, moe_layer_end_index and
moe_layer_interval pick, a mixture of experts instead of the dense MLP: a softmax router
whose top-k choice adds a per-expert bias (e_score_correction_bias; the weights are the
unbiased probabilities), the chosen weights renormalized (their sum clamped at
moe_norm_min), plus shared experts on every token.

Reference: transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py. Parameter names
are the Hub checkpoints' (mlp.experts.N.gate_proj, mlp.moe_statics.*), which
transformers fuses when it loads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from llmrun.models import ernie4_5
from llmrun.models.base import CausalLM, DecoderLayer, GatedMLP, mix_experts


@dataclass
class ModelArgs(ernie4_5.ModelArgs):
    # Ernie4_5_MoeConfig's defaults.
    moe_intermediate_size: int = 1536
    moe_num_experts: int = 64
    moe_k: int = 6
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # -1: the last layer
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_layer_end_index == -1:
            self.moe_layer_end_index = self.num_hidden_layers - 1

    def has_experts(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (else the dense MLP)."""
        return (
            (layer + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= layer <= self.moe_layer_end_index
        )


class Statics(nn.Module):
    """The router's per-expert selection bias, [1, experts] as the checkpoints hold it."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, experts))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.norm_min = args.moe_k, args.moe_norm_min
        self.gate = nn.Linear(args.hidden_size, args.moe_num_experts, bias=False)
        self.moe_statics = Statics(args.moe_num_experts)
        # The experts have no biases, whatever use_bias says (the shared ones follow it).
        expert = dataclasses.replace(
            args, intermediate_size=args.moe_intermediate_size, use_bias=False
        )
        self.experts = nn.ModuleList(GatedMLP(expert) for _ in range(args.moe_num_experts))
        shared = args.moe_intermediate_size * args.moe_num_shared_experts
        self.shared_experts = (
            GatedMLP(dataclasses.replace(args, intermediate_size=shared)) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [B, T, D] -> [N, D]
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        bias = self.moe_statics.e_score_correction_bias[0].float()
        indices = torch.topk(probs + bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        out = mix_experts(flat, weights.to(x.dtype), indices, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class Layer(DecoderLayer):
    """ERNIE 4.5's pre-norm layer, with experts where args.has_experts says so."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, SparseMoeBlock if args.has_experts(layer) else mlp)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, ernie4_5.Attention, GatedMLP, Layer)
        # Unlike the dense ERNIE 4.5, its output projection has a bias with use_bias too.
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.use_bias)
