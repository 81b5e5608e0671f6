"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 with a mixture-of-experts
feed-forward: top-k routed experts plus a shared expert behind a sigmoid gate.

Reference: transformers/models/qwen2_moe/modeling_qwen2_moe.py. Parameter names are
the Hub's per-expert checkpoint keys (`mlp.experts.N.gate_proj`, ...): one module per
expert, as Mixtral's (llmrun.models.mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import UnsupportedError
from llmrun.models import base
from llmrun.models.base import (
    CausalLM,
    GatedMLP,
    TopKExperts,
    activation,
    args_from_config,
    check_top_k,
)
from llmrun.models.qwen2 import Attention


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 5632  # the dense layers' (mlp_only_layers)
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    qkv_bias: bool = True
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_sliding_window:
            raise UnsupportedError("Qwen2-MoE with use_sliding_window=true is not supported")
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) of a given width: an expert, the shared expert or a
    dense layer's feed-forward."""

    def __init__(self, args: ModelArgs, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, args.hidden_size, bias=False)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gated(self.act, self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(TopKExperts):
    """The top-k experts of the router's softmax (renormalized if norm_topk_prob),
    plus the shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(
            args,
            args.num_experts,
            lambda: MLP(args, args.moe_intermediate_size),
            args.norm_topk_prob,
        )
        self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        routed = self.routed(x2)
        shared = torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return (routed + shared).view(x.shape)


class DecoderLayer(base.DecoderLayer):
    """A pre-norm block whose feed-forward is the experts where args.sparse(layer) says,
    else dense (intermediate_size wide)."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp if args.sparse(layer) else GatedMLP)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, SparseMoeBlock, DecoderLayer)
