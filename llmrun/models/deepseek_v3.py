"""DeepSeek-V3 (V3, R1, Kimi K2, Moonlight): DeepSeek-V2's multi-head latent attention
and experts with another router. Each expert's score is the sigmoid of its logit; the
experts are chosen by score + e_score_correction_bias, among the topk_group of n_group
groups whose two best biased scores sum highest ("noaux_tc"); their weights are the
unbiased scores, renormalized with norm_topk_prob, times routed_scaling_factor.
rope_interleave (default true) says whether RoPE turns adjacent pairs.

Reference: transformers/models/deepseek_v3/modeling_deepseek_v3.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v2
from llmrun.models.base import args_from_config

TOPK_METHOD, SCORING = "noaux_tc", "sigmoid"


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    # transformers' DeepseekV3Config defaults where they differ from V2's.
    num_experts_per_tok: int = 8
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    topk_method: str = TOPK_METHOD
    scoring_func: str = SCORING
    n_group: int | None = 8
    topk_group: int | None = 4
    max_position_embeddings: int = 4096

    def check_routing(self) -> None:
        if (self.topk_method, self.scoring_func) != (TOPK_METHOD, SCORING):
            raise UnsupportedError(
                f"DeepSeek-V3 with topk_method {self.topk_method!r} and scoring_func "
                f"{self.scoring_func!r} is not supported ({TOPK_METHOD!r} with {SCORING!r})"
            )
        if (self.n_group or 1) > 1 and self.n_routed_experts // self.n_group < 2:
            raise UnsupportedError(
                "DeepSeek-V3 groups of one expert are not supported (a group scores its best two)"
            )

    @property
    def grouped(self) -> bool:
        return (self.n_group or 1) > 1

    @property
    def group_score(self) -> str:
        return "top2"  # noaux_tc: the sum of a group's two best

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config = {**config, "n_routed_experts": config["num_local_experts"]}
        return args_from_config(cls, config, nullable=("q_lora_rank", "n_shared_experts"))


class Router(deepseek_v2.Router):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def selection_bias(self) -> torch.Tensor:
        return self.e_score_correction_bias.float()


class MoE(deepseek_v2.MoE):
    router = Router


class Layer(deepseek_v2.Layer):
    moe = MoE


class Model(deepseek_v2.Model):
    layer = Layer
