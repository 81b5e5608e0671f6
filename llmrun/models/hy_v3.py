"""Hunyuan V3 (Tencent Hy3; llama.cpp's "hy_v3" GGUFs): Qwen3's attention (an RMSNorm
over each query and key head before RoPE, whole heads rotated) in front of dense
feed-forwards where mlp_layer_types says "dense" (the first layer by default) and
experts elsewhere: each token's top k by sigmoid score + e_score_correction_bias,
weighted by the unbiased scores renormalized over the k (+1e-20) times
router_scaling_factor, plus shared experts num_shared_experts experts wide, their sum
taken in f32 with enable_moe_fp32_combine.

Unlike Hunyuan dense (hunyuan_v1_dense), the q/k norms act before RoPE and there is no
NTK-alpha stretch of the base. The Hub's checkpoints hold multi-token-prediction
layers past num_hidden_layers; transformers ignores them, and so does llmrun
(llmrun/loading/hy_v3.py drops them, and renames the Hub's router, selection bias and
shared expert to transformers' names, which the modules here carry).

Reference: transformers/models/hy_v3/modeling_hy_v3.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v2, qwen3
from llmrun.models.base import (
    CausalLM,
    GatedMLP,
    args_from_config,
    check_top_k,
    mix_experts,
    route_grouped,
)
from llmrun.models.qwen3_moe import MLP

DEFAULT_THETA = 11_158_840.0  # HYV3Config.default_theta
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs:
    # HYV3Config's defaults.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 13312  # the dense layers'
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 192
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1536
    router_scaling_factor: float = 2.826
    enable_moe_fp32_combine: bool = True
    mlp_layer_types: list[str] | None = None
    # Tencent's field, which llama.cpp's converter reads; transformers always renormalizes.
    route_norm: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(layers, 1) + ["sparse"] * (layers - 1)
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: it needs one of "
                f"{', '.join(MLP_TYPES)} for each of the {layers} layers"
            )
        if self.mlp_bias:
            raise UnsupportedError("Hunyuan V3 with mlp_bias=true is not supported")
        if not self.route_norm:
            raise UnsupportedError(
                "Hunyuan V3 with route_norm=false is not supported: transformers renormalizes "
                "the top-k expert weights whatever the config says, llama.cpp does not"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        if not config.get("rope_parameters") and "rope_theta" not in config:
            config = {**config, "rope_theta": DEFAULT_THETA}
        return args_from_config(cls, config)

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return self.mlp_layer_types[layer] == "sparse"


class MoE(nn.Module):
    """Routed experts plus the shared experts every token goes through; the selection
    bias is the block's (transformers' e_score_correction_bias), not the router's."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))
        width = args.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(args, width) for _ in range(args.num_experts))
        self.shared_experts = MLP(args, width * args.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        # The router in f32, as transformers keeps it.
        logits = nn.functional.linear(x2.float(), self.gate.weight.float())
        weights, indices = route_grouped(
            logits,
            self.top_k,
            scoring="sigmoid",
            bias=self.e_score_correction_bias.float(),
            normalize=True,
            scale=a.router_scaling_factor,
        )
        routed = mix_experts(x2, weights.to(x.dtype), indices, self.experts).view(x.shape)
        shared = self.shared_experts(x)
        if a.enable_moe_fp32_combine:
            return (routed.float() + shared.float()).to(x.dtype)
        return routed + shared


class Layer(deepseek_v2.Layer):
    moe = MoE


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen3.Attention, GatedMLP, Layer)
