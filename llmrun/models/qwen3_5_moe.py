"""Qwen3.5-MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's hybrid of Gated DeltaNet
and gated attention layers, with a mixture-of-experts feed-forward in every layer: the
top-k of the router's softmax, renormalized, plus a shared expert behind a sigmoid gate
(Qwen2-MoE's block).

Reference: transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py. Parameter names are
the Hub's per-expert checkpoint keys (`mlp.experts.N.gate_proj`, ...); a folder saved by
transformers 5, which fuses them, is split into those at loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmrun.models import qwen2_moe, qwen3_5
from llmrun.models.base import check_top_k


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True  # read by Qwen2-MoE's block
    # Qwen3.5-MoE's router always renormalizes its top-k weights (its config has no flag).
    always_renormalized: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")
        self.norm_topk_prob = self.norm_topk_prob or self.always_renormalized


class Model(qwen3_5.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, qwen2_moe.SparseMoeBlock)
