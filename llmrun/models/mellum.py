"""Mellum (JetBrains Mellum2; llama.cpp's "mellum" GGUFs): Qwen3-MoE's attention (an
RMSNorm on each query and key head before RoPE) and experts (each token's top k of a
softmax over the router's logits, renormalized with norm_topk_prob, no shared expert),
in Laguna's layout: global and sliding-window layers (layer_types), each type with its
RoPE (rope_parameters keyed by layer type; by default base 5e5 for the global layers and
1e4 for the sliding ones, whole heads rotated), and a dense feed-forward where
mlp_layer_types says "dense" (none by default). The Hub's checkpoints may hold a
multi-token-prediction layer (mtp.*), which transformers ignores, and so does llmrun.

Reference: transformers/models/mellum/modular_mellum.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmrun.errors import ModelFormatError
from llmrun.models import deepseek_v2, laguna, qwen3_moe
from llmrun.models.base import (
    Frame,
    args_from_config,
    attend_scaled,
    check_top_k,
    sliding_windows,
    windowed_layer_types,
)
from llmrun.models.cache import KVCache

# MellumConfig's RoPE of each layer type where a config gives none.
DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs:
    # MellumConfig's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 7168  # the dense layers'
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = 1024
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 896
    norm_topk_prob: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        self.layer_types = windowed_layer_types(
            self.layer_types or ["full_attention"] * layers, layers, self.sliding_window
        )
        self.mlp_layer_types = list(self.mlp_layer_types or ["sparse"] * layers)
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: it needs one of "
                f"{', '.join(MLP_TYPES)} for each of the {layers} layers"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            # transformers 5 writes num_experts under its alias.
            config = {**config, "num_experts": config["num_local_experts"]}
        ropes = laguna.rope_by_layer_type(config, DEFAULT_ROPE)
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        # sliding_window: null is no window.
        args = args_from_config(cls, flat, nullable=("sliding_window",))
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return self.mlp_layer_types[layer] == "sparse"

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global layers."""
        return sliding_windows(self.layer_types, self.sliding_window)


class Attention(qwen3_moe.Attention):
    """Qwen3-MoE's attention in its layer type's frame: that type's RoPE, and for the
    sliding layers the window (their cache may keep only it)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.layer_type = args.layer_types[layer]

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        return super().forward(x, frames[self.layer_type], cache)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> torch.Tensor:
        return attend_scaled(q, k, v, self.layer, frame, cache, self.head_dim**-0.5)


class Layer(deepseek_v2.Layer):
    """A pre-norm block whose feed-forward is Qwen3-MoE's experts where mlp_layer_types
    says "sparse", else dense."""

    moe = qwen3_moe.SparseMoeBlock


class Model(laguna.Model):
    attention = Attention
    layer = Layer
