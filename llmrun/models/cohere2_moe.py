"""Cohere 2 MoE (Cohere2MoeForCausalLM, Command A MoE; llama.cpp's "cohere2moe" GGUFs):
Cohere 2 (cohere2.py: the parallel block, adjacent-pair RoPE in the sliding-window layers
only, logit_scale) with a mixture of experts in every layer but the leading dense ones
(`mlp_layer_types`; a config.json may say `first_k_dense_replace`), which also rotate
when `prefix_dense_sliding_window_pattern` is 1. The router picks the top-k of its
logits and weighs them by their softmax, or by their sigmoids (`expert_selection_fn`),
renormalized with `norm_topk_prob`; shared experts (num_shared_experts of them, one MLP
that wide) join the routed ones averaged or summed. The norms are RMSNorms where
rms_norm_eps is set, else Cohere's LayerNorm; heads are head_dim wide.

Reference: transformers/models/cohere2_moe/modeling_cohere2_moe.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import cohere, cohere2
from llmrun.models.base import GatedMLP, RMSNorm, check_top_k, mix_experts, route

SELECTIONS = ("softmax", "sigmoid")
COMBINATIONS = ("average", "sum")
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs(cohere2.ModelArgs):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True
    mlp_layer_types: list[str] | None = None
    first_k_dense_replace: int = 0
    prefix_dense_sliding_window_pattern: int = 1
    prefix_dense_intermediate_size: int | None = None
    rms_norm_eps: float | None = None

    def __post_init__(self) -> None:
        head_dim = self.head_dim  # Cohere2MoeConfig's own, not hidden / heads
        layers, dense = self.num_hidden_layers, self.first_k_dense_replace
        if self.layer_types is None:
            # transformers' default: the dense prefix and the rest each in its pattern.
            self.layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for count, pattern in (
                    (dense, self.prefix_dense_sliding_window_pattern),
                    (layers - dense, self.sliding_window_pattern),
                )
                for i in range(count)
            ]
        super().__post_init__()
        self.head_dim = head_dim or self.head_dim
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < dense else "sparse" for i in range(layers)]
        if len(self.mlp_layer_types) != layers or set(self.mlp_layer_types) - set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types {self.mlp_layer_types} is not 'dense' or 'sparse' for each "
                f"of the {layers} layers"
            )
        for name, value, allowed in (
            ("expert_selection_fn", self.expert_selection_fn, SELECTIONS),
            ("shared_expert_combination_strategy", self.shared_expert_combination_strategy,
             COMBINATIONS),
        ):  # fmt: skip
            if value not in allowed:
                raise UnsupportedError(
                    f"Cohere 2 MoE with {name} {value!r} is not supported ({', '.join(allowed)})"
                )
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE: the sliding ones, and the dense prefix where its
        pattern is 1 (transformers' force_rope)."""
        return self.layer_types[layer] == "sliding_attention" or (
            self.mlp_layer_types[layer] == "dense" and self.prefix_dense_sliding_window_pattern == 1
        )


class Attention(cohere2.Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.rotary = args.rotates(layer)


class SparseMoeBlock(nn.Module):
    """The router's top-k experts, weighed by the softmax of their logits or by their
    sigmoids (renormalized with norm_topk_prob), and the shared experts' MLP, averaged
    with them or added."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.sigmoid = args.expert_selection_fn == "sigmoid"
        self.normalize = args.norm_topk_prob
        self.average = args.shared_expert_combination_strategy == "average"
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(args) for _ in range(args.num_experts))
        self.shared_experts = None
        if args.num_shared_experts:
            width = args.intermediate_size * args.num_shared_experts
            self.shared_experts = GatedMLP(dataclasses.replace(args, intermediate_size=width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        logits = self.gate(x2)
        if self.sigmoid:
            top, indices = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.sigmoid(top)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # the softmax of the top k logits: the renormalized top k of the softmax
            weights, indices = route(logits, self.top_k, normalize=True)
        out = mix_experts(x2, weights, indices, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
            if self.average:
                out = out / 2
        return out.view(x.shape)


class DecoderLayer(cohere.DecoderLayer):
    """Cohere's parallel block with the layer's feed-forward (the dense prefix's MLP or
    the experts) and norm (RMSNorm where rms_norm_eps is set)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        nn.Module.__init__(self)
        self.self_attn = attention(args, layer)
        if args.mlp_layer_types[layer] == "dense":
            width = args.prefix_dense_intermediate_size or args.intermediate_size
            self.mlp = GatedMLP(dataclasses.replace(args, intermediate_size=width))
        else:
            self.mlp = SparseMoeBlock(args)
        self.input_layernorm = norm(args)


def norm(args: ModelArgs) -> nn.Module:
    if args.rms_norm_eps is not None:
        return RMSNorm(args.hidden_size, args.rms_norm_eps)
    return cohere.LayerNorm(args.hidden_size, args.layer_norm_eps)


class Model(cohere2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, DecoderLayer, Attention, norm(args))
