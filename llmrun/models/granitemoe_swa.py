"""IBM Granite 4.x mixture of experts with sliding-window attention
(GraniteMoeSWAForCausalLM; llama.cpp's "granite_swa" GGUFs with experts): Granite 4's
sliding-window and full layers, attention sinks and per-layer RoPE bases
(granite_swa.py) with Granite 3's mixture of experts (granitemoe.py: the top-k experts
of a softmax router, renormalized, plus an always-on shared expert where
shared_intermediate_size is set).

Reference: transformers/models/granitemoe_swa/modeling_granitemoe_swa.py. The
checkpoints hold each layer's experts fused (block_sparse_moe.experts.gate_up_proj
[E, 2I, D]: gate rows, then up rows; down_proj [E, D, I]; shared_mlp.input_linear
likewise); llmrun/loading/granite.py splits them into the per-expert modules, as for
Granite 3's MoE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import granite_swa, granitemoe
from llmrun.models.base import args_from_config


@dataclass
class ModelArgs(granite_swa.ModelArgs, granitemoe.ModelArgs):
    rms_norm_eps: float = 1e-6  # GraniteMoeSWAConfig's defaults
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return args_from_config(cls, config)


class Model(granite_swa.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, granitemoe.SparseMoeBlock)
