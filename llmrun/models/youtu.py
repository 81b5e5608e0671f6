"""Youtu-LLM (Tencent's Youtu-LLM-2B, HF `youtu`): DeepSeek-V3's multi-head latent
attention (the cached latent, adjacent-pair RoPE with rope_interleave, YaRN's
mscale_all_dim on the softmax) in every layer, and a dense SwiGLU feed-forward in every
layer: no experts, no router. The input and output embeddings are tied by default.
llama.cpp converts it to a "deepseek2" GGUF whose every block is a leading dense one
(llmrun/loading/deepseek2.py).

Reference: transformers/models/youtu/modeling_youtu.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import deepseek_v2
from llmrun.models.base import args_from_config


@dataclass
class ModelArgs(deepseek_v2.ModelArgs):
    # YoutuConfig's defaults where they differ from DeepSeek-V2's; it has no experts.
    num_experts_per_tok: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int | None = None
    intermediate_size: int = 6144
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        self.first_k_dense_replace = self.num_hidden_layers  # every layer dense
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # YoutuConfig has no expert fields; a config.json that states some is not read.
        experts = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts")
        config = {k: v for k, v in config.items() if k not in experts}
        return args_from_config(cls, config, nullable=("q_lora_rank",))


class Model(deepseek_v2.Model):
    """DeepSeek-V2's model, every layer dense (ModelArgs.sparse is false throughout)."""
