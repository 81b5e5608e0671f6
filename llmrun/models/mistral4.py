"""Mistral 4 (`mistral4`; llama.cpp's GGUF arch "mistral4"): DeepSeek-V3's layers
(multi-head latent attention, routed and shared experts) with a softmax router, and
Llama 4's query temperature past the original context.

The router scores each expert by the softmax of its logit; with n_group > 1 the experts
are chosen among the topk_group groups whose two best scores sum highest (V3's grouping,
without its correction bias), and their weights are their scores, renormalized with
norm_topk_prob, times routed_scaling_factor. The queries at position p are scaled by
1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings)), as
Ministral 3's are. The Hub's checkpoints hold each layer's experts stacked
(experts.gate_up_proj, experts.down_proj); the loader splits them.

Reference: transformers/models/mistral4/modeling_mistral4.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import deepseek_v2
from llmrun.models.base import args_from_config

MODEL_TYPE = "mistral4"
# transformers' Mistral4Config rope_parameters where a config.json has none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    # transformers' Mistral4Config defaults where they differ from DeepSeek-V2's.
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 128
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 4
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    n_group: int | None = 1
    topk_group: int | None = 1
    kv_lora_rank: int = 256
    q_lora_rank: int | None = 1024
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    max_position_embeddings: int = 1048576
    topk_method: str = MODEL_TYPE  # no such config field: Mistral 4 has one router
    scoring_func: str = "softmax"

    def check_routing(self) -> None:
        if (self.n_group or 1) > 1 and self.n_routed_experts // self.n_group < 2:
            raise UnsupportedError(
                "Mistral 4 groups of one expert are not supported (a group scores its best two)"
            )

    @property
    def grouped(self) -> bool:
        return (self.n_group or 1) > 1

    @property
    def group_score(self) -> str:
        return "top2"  # the sum of a group's two best scores

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = {**config, "topk_method": MODEL_TYPE, "scoring_func": "softmax"}
        if "n_routed_experts" not in config and "num_local_experts" in config:
            config["n_routed_experts"] = config["num_local_experts"]
        if not (config.get("rope_parameters") or config.get("rope_scaling")):
            config["rope_parameters"] = DEFAULT_ROPE
        params = dict(config.get("rope_parameters") or config["rope_scaling"])
        # transformers turns the RoPE part of each head by a partial factor of the whole
        # head (qk_nope + qk_rope): that is DeepSeek's qk_rope_head_dim features.
        partial = params.pop("partial_rotary_factor", None)
        nope = config.get("qk_nope_head_dim", cls.qk_nope_head_dim)
        rope = config.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        if partial is not None and abs(partial * (nope + rope) - rope) > 1e-6:
            raise UnsupportedError(
                f"Mistral 4 with partial_rotary_factor {partial} is not supported (RoPE on "
                f"the qk_rope_head_dim {rope} features of {nope + rope} only)"
            )
        config["rope_parameters"] = params
        config.pop("rope_scaling", None)
        return args_from_config(cls, config, nullable=("q_lora_rank", "n_shared_experts"))


# The layers are DeepSeek-V2's (its router without a selection bias); ModelArgs says how
# they route and scale.
Model = deepseek_v2.Model
