"""A.X K1 (SK Telecom's skt/A.X-K1, AXK1ForCausalLM): DeepSeek-V3's model (multi-head
latent attention, always with a query bottleneck; sigmoid-scored experts chosen in groups
with e_score_correction_bias, a shared expert) with one change: an RMSNorm on the output
of each expert layer's feed-forward (routed plus shared), `post_mlp_layernorm`, which the
Hub's checkpoints keep in the decoder layer. The dense layers are those `mlp_layer_types`
names, or, where a config lists none, the first first_k_dense_replace (default 1).

Reference: transformers/models/axk1/modular_axk1.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmrun.models import deepseek_v3, glm4_moe_lite
from llmrun.models.base import Frame, RMSNorm, args_from_config
from llmrun.models.cache import KVCache


@dataclass
class ModelArgs(glm4_moe_lite.ModelArgs):
    # AXK1Config's defaults where they differ from GLM-4.7-Flash's.
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 192
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int | None = 8
    topk_group: int | None = 4
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Every A.X K1 layer has the query bottleneck: q_lora_rank is not nullable here.
        return args_from_config(cls, with_mlp_layer_types(config))


def with_mlp_layer_types(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its experts under n_routed_experts and, where it lists no
    mlp_layer_types, those that the legacy first_k_dense_replace (default 1) and
    moe_layer_freq (default 1) give, as AXK1Config and AXK2Config read them."""
    config = dict(config)
    if "n_routed_experts" not in config and "num_local_experts" in config:
        config["n_routed_experts"] = config["num_local_experts"]
    first = config.pop("first_k_dense_replace", None)
    frequency = config.pop("moe_layer_freq", None) or 1
    if config.get("mlp_layer_types") is None and "num_hidden_layers" in config:
        first = 1 if first is None else first
        config["mlp_layer_types"] = [
            "sparse" if i >= first and i % frequency == 0 else "dense"
            for i in range(config["num_hidden_layers"])
        ]
    return config


class Layer(deepseek_v3.Layer):
    """DeepSeek-V3's layer, its experts' output normalized by post_mlp_layernorm."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__(args, layer, attention, mlp)
        sparse = args.sparse(layer)
        self.post_mlp_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if sparse else None

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        fed = self.mlp(self.post_attention_layernorm(x))
        if self.post_mlp_layernorm is not None:
            fed = self.post_mlp_layernorm(fed)
        return x + fed


class Model(deepseek_v3.Model):
    layer = Layer
