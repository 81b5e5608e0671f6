"""MiniCPM5-MoE (openbmb/MiniCPM5-15B-A2.5B; Hugging Face folders only: llama.cpp's
converter writes no GGUF of it): Llama's attention, without q/k norms, whose query
projection is twice as wide, each head's query then its gate, the output multiplied by
sigmoid(gate) before o_proj (Qwen3.5's gated attention, qwen3_5.py); whole heads
rotated, halves turned, base 5e6 where a config gives none. Dense feed-forwards where
mlp_layer_types says "dense" (by default the first first_k_dense_replace = 1 layers),
elsewhere DeepSeek-V3's experts (deepseek_v3.py): sigmoid scores, chosen by score +
e_score_correction_bias among the topk_group best of n_group groups (a group scored by
its best two), weighted by the unbiased scores renormalized with norm_topk_prob times
routed_scaling_factor, plus n_shared_experts always-on experts' width.

The Hub's checkpoints name the query and gate projection self_attn.q_proj (transformers
renames it q_gate_proj), as llmrun does, and hold one key per expert.

Reference: transformers/models/minicpm5_moe/modular_minicpm5_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3, glm4_moe, qwen3_5
from llmrun.models.base import CausalLM, GatedMLP

DEFAULT_ROPE_THETA = 5000000.0  # MiniCPM5MoeConfig.default_theta
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    # MiniCPM5MoeConfig's defaults.
    intermediate_size: int = 8192  # the dense layers'
    moe_intermediate_size: int = 512
    n_routed_experts: int = 160
    num_experts_per_tok: int = 16
    routed_scaling_factor: float = 3.66
    num_key_value_heads: int | None = 2
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 524288
    mlp_layer_types: list[str] | None = None

    # Whole heads rotated where a config gives no partial_rotary_factor.
    default_partial_rotary_factor = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:
            dense = min(self.first_k_dense_replace, layers)
            self.mlp_layer_types = ["dense"] * dense + ["sparse"] * (layers - dense)
        if len(self.mlp_layer_types) != layers or not set(self.mlp_layer_types) <= set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: it needs one of "
                f"{', '.join(MLP_TYPES)} for each of the {layers} layers"
            )

    def sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("use_gated_attention") is False:
            raise UnsupportedError(
                "MiniCPM5-MoE with use_gated_attention=false is not supported "
                "(transformers refuses it too)"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in rope and "rope_theta" not in config:
            config = {**config, "rope_theta": DEFAULT_ROPE_THETA}
        return super().from_config(config)


class Attention(qwen3_5.Attention):
    """Qwen3.5's gated attention without its q/k norms, every layer's keys and values
    in the cache."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, GatedMLP, deepseek_v3.Layer)
