"""OLMoE (AllenAI's OLMoE-1B-7B; llama.cpp's "olmoe" GGUFs): OLMo 2's attention (an
RMSNorm over each whole query and key projection, all heads together) in a pre-norm
layer like Llama's, and a mixture of experts: the top-k of the router's softmax,
weighed by their probabilities as they are (renormalized only with norm_topk_prob, off
in the released models).

Reference: transformers/models/olmoe/modeling_olmoe.py. Parameter names are the Hub's
per-expert checkpoint keys (`mlp.gate`, `mlp.experts.N.gate_proj`, ...), as Qwen3-MoE's
(qwen3_moe.SparseMoeBlock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import olmo2, qwen3_moe
from llmrun.models.base import CausalLM, args_from_config, check_top_k


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.clip_qkv is not None:
            raise UnsupportedError(
                f"OLMoE with clip_qkv ({self.clip_qkv}) is not supported (the released "
                "models have none)"
            )
        check_top_k(self.num_experts_per_tok, self.num_experts, "num_experts")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        # OlmoeAttention's norms are hidden_size / heads wide a head, whatever head_dim says.
        self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's width (qwen3_moe.SparseMoeBlock's name for it)."""
        return self.intermediate_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        return args_from_config(cls, config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, olmo2.Attention, qwen3_moe.SparseMoeBlock)
