"""Kolibri-1 (Aleph Alpha): EXAONE 4.0's attention (an RMSNorm over each query and key
head; windowed layers that rotate and global layers without any position encoding,
every fifth layer global by default) in GLM-4's blocks (a norm after
each sublayer as well as before it), whose feed-forward is always experts: each token's
top k by router logit + e_score_correction_bias (computed in f32), weighted by the
sigmoid of their unbiased logits (renormalized with norm_topk_prob, off by default),
plus one shared expert shared_expert_intermediate_size wide.

Reference: transformers/models/kolibri1/modeling_kolibri1.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models import exaone4, glm4
from llmrun.models.base import (
    CausalLM,
    LayerTypes,
    args_from_config,
    check_layer_types,
    check_top_k,
    mix_experts,
    sliding_windows,
)
from llmrun.models.qwen3_moe import MLP

GLOBAL_EVERY = 5  # Kolibri1Config's default layer_types: every fifth layer global


@dataclass
class ModelArgs:
    # Kolibri1Config's defaults.
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int = 50
    num_attention_heads: int = 48
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    sliding_window: int | None = 513
    layer_types: list[str] | None = None
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 384
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = False
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        self.check_window_and_experts()

    def check_window_and_experts(self) -> None:
        if not self.sliding_window or self.sliding_window < 0:
            # transformers' Kolibri1Model cannot run one either (its masks need the window).
            raise ModelFormatError(
                f"Kolibri-1's sliding_window is {self.sliding_window!r}; it needs a positive one"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Kolibri1Config saves num_experts as num_local_experts (its attribute_map).
        if "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        return args_from_config(cls, config, nullable=("sliding_window",))

    # The global layers go without RoPE (what exaone4.Attention reads).
    hybrid = True

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Router(nn.Module):
    """Each token's experts, chosen by logit + bias, and their weights: the sigmoid of
    the unbiased logits. Logits in f32, as transformers computes them on CPU."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, top_k] in x's dtype and expert indices [N, top_k]."""
        logits = F.linear(x.float(), self.weight.float())
        indices = torch.topk(logits + self.e_score_correction_bias.float(), self.top_k).indices
        weights = logits.gather(1, indices).sigmoid()
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), indices


class MoE(nn.Module):
    """Routed experts plus the shared expert every token goes through."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Router(args)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )
        self.shared_experts = MLP(args, args.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices = self.gate(x2)
        out = mix_experts(x2, weights, indices, self.experts).view(x.shape)
        return out + self.shared_experts(x)


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, exaone4.Attention, MoE, glm4.DecoderLayer)
