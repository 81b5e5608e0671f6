"""Ling 1 (inclusionAI's Ling-lite, Ling-plus, Ling-Coder-lite; the Hub's
BailingMoeForCausalLM, model_type "bailing_moe"; llama.cpp's GGUF arch "bailingmoe"):

- Llama's grouped-query attention whose queries, keys and values come from one fused
  query_key_value projection (split at the loader edge into q_proj, k_proj, v_proj: all
  queries' rows, then keys', then values'), biased where use_qkv_bias, RoPE on whole
  heads with halves turned, no bias on the output projection;
- first_k_dense_replace dense SwiGLU layers, then experts chosen by the top
  num_experts_per_tok softmax scores, weighted by those scores (renormalized where
  norm_topk_prob and a token takes more than one), plus num_shared_experts experts'
  width of shared SwiGLU;
- with norm_head, the output matrix's columns scaled to unit length (undone at the
  loader edge: the folder's matrix is divided there, as llama.cpp's converter divides it
  before writing a GGUF).

Refused where the published code computes what this does not: biases on the output and
feed-forward projections (use_bias, true where a config leaves it out), its own RoPE
scalings (rope_scaling).

Reference: modeling_bailing_moe.py of inclusionAI/Ling-lite (github.com/inclusionAI/Ling,
models/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import bailing_moe_v2, deepseek_v2, glm4_moe
from llmrun.models.base import CausalLM, GatedMLP


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    # BailingMoeConfig's defaults where they differ.
    n_routed_experts: int = 16
    n_shared_experts: int = 0
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 16384

    # What deepseek_v2's router reads: softmax scores, no groups, no bias.
    scoring_func = "softmax"
    default_partial_rotary_factor = 1.0

    def __post_init__(self) -> None:
        self.n_group, self.topk_group, self.use_qk_norm = 1, 1, False
        self.routed_scaling_factor = 1.0
        # The published router renormalizes only the weights of two or more experts.
        self.norm_topk_prob = self.norm_topk_prob and self.num_experts_per_tok > 1
        super().__post_init__()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("use_bias", True):  # BailingMoeConfig's default
            raise UnsupportedError(
                "Ling with use_bias true or absent (biases on the attention output and "
                "feed-forward projections) is not supported"
            )
        if config.get("rope_scaling"):
            raise UnsupportedError(
                "Ling with rope_scaling is not supported (the published code scales RoPE "
                "its own way)"
            )
        config = dict(config)
        config.pop("partial_rotary_factor", None)  # the published code turns whole heads
        for old, new in bailing_moe_v2.RENAMED.items():
            if old in config:
                config[new] = config.pop(old)
        if config.get("n_shared_experts") is None:
            config["n_shared_experts"] = 0  # the published code: no shared experts
        config.setdefault("norm_topk_prob", True)  # BailingMoeConfig's default
        return super().from_config(config)


class Model(CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, glm4_moe.Attention, GatedMLP, deepseek_v2.Layer)
