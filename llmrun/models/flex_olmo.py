"""FlexOlmo (AllenAI's FlexOlmo-7x7B-1T): OLMoE's model (OLMo 2's attention, the top-k
of the router's softmax over the experts, weighed as they are unless norm_topk_prob) in
OLMo 2's blocks, the norms after each sublayer instead of before it; FlexOlmoConfig's
defaults (a RoPE base of 500000 where a config gives none).

Reference: transformers/models/flex_olmo/modular_flex_olmo.py. Parameter names are the
Hub's per-expert checkpoint keys (`mlp.gate`, `mlp.experts.N.gate_proj`, ...), as OLMoE's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import olmo2, olmoe, qwen3_moe
from llmrun.models.base import CausalLM

DEFAULT_THETA = 500000.0  # FlexOlmoConfig.default_theta


@dataclass
class ModelArgs(olmoe.ModelArgs):
    # FlexOlmoConfig's defaults where they differ from OLMoE's.
    rms_norm_eps: float = 1e-6
    num_experts: int = 7
    num_experts_per_tok: int = 5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        nested = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" not in config and "rope_theta" not in nested:
            config = {**config, "rope_theta": DEFAULT_THETA}
        return super().from_config(config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, olmo2.Attention, qwen3_moe.SparseMoeBlock, olmo2.DecoderLayer)
