"""EXAONE MoE (LG AI Research's K-EXAONE; llama.cpp's "exaone-moe" GGUFs): EXAONE 4.0's
attention (an RMSNorm over each query and key head before RoPE; with a sliding window,
windowed layers that rotate mixed with global layers without any position encoding)
in pre-norm blocks (unlike EXAONE 4.0's post-norms), whose feed-forward is dense in the
first layers (first_k_dense_replace, or mlp_layer_types) and DeepSeek-V3's experts
after them: sigmoid scores, chosen by score + e_score_correction_bias among the
topk_group best of n_group groups, weighted by the unbiased scores (renormalized with
norm_topk_prob) times routed_scaling_factor, plus num_shared_experts shared experts.

The Hub's checkpoints hold multi-token-prediction weights (mtp.*) that transformers
ignores, and so does llmrun.

Reference: transformers/models/exaone_moe/modeling_exaone_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import deepseek_v3, exaone4
from llmrun.models.base import CausalLM, GatedMLP, LayerTypes, args_from_config

SCORING = "sigmoid"
MLP_TYPES = ("dense", "sparse")


@dataclass
class ModelArgs(exaone4.ModelArgs):
    # ExaoneMoeConfig's defaults.
    moe_intermediate_size: int = 1024
    num_experts: int = 64
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    mlp_layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "dense" if i < self.first_k_dense_replace else "sparse" for i in range(layers)
            ]
        if len(self.mlp_layer_types) != layers or set(self.mlp_layer_types) - set(MLP_TYPES):
            raise ModelFormatError(
                f"mlp_layer_types is {self.mlp_layer_types!r}: one of {', '.join(MLP_TYPES)} "
                f"for each of the {layers} layers"
            )
        experts, groups = self.num_experts, self.n_group
        if groups < 1 or experts % groups:
            raise ModelFormatError(f"{experts} experts do not split into n_group {groups} groups")
        if groups > 1 and experts // groups < 2:
            raise UnsupportedError(
                "EXAONE MoE groups of one expert are not supported (a group scores its best two)"
            )
        if not 0 < self.topk_group <= groups:
            raise ModelFormatError(f"topk_group is {self.topk_group}, but n_group is {groups}")
        reachable = experts // groups * self.topk_group
        if not 0 < self.num_experts_per_tok <= reachable:
            raise ModelFormatError(
                f"num_experts_per_tok is {self.num_experts_per_tok}, but a token can reach "
                f"{reachable} of the {experts} experts (num_experts, n_group, topk_group)"
            )

    # What deepseek_v3's router and experts read.
    scoring_func = SCORING
    group_score = "top2"

    @property
    def n_routed_experts(self) -> int:
        return self.num_experts

    @property
    def n_shared_experts(self) -> int:
        return self.num_shared_experts

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense feed-forward)."""
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # sliding_window: null is no window (every layer global and rotating), as in EXAONE 4.
        return args_from_config(cls, config, nullable=("sliding_window",))


class Model(LayerTypes, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, exaone4.Attention, GatedMLP, deepseek_v3.Layer)
