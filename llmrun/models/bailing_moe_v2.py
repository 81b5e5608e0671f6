"""Ling 2.0 (inclusionAI's Ling-mini-2.0, Ling-flash-2.0, Ling-1T, Ring-mini-2.0; the
Hub's BailingMoeV2ForCausalLM, whose config.json says model_type "bailing_moe" as Ling
1's does: llmrun.loading.bailingmoe tells them apart by `architectures`; llama.cpp's
GGUF arch "bailingmoe2"). What it computes is GLM-4.5 MoE's (llmrun.models.glm4_moe):

- grouped-query attention whose queries, keys and values come from one fused
  query_key_value projection (split at the loader edge into q_proj, k_proj, v_proj:
  all queries' rows, then keys', then values'), per-head RMSNorms of the queries and
  keys (use_qk_norm), RoPE on the first partial_rotary_factor of each head (halves
  turned; rotary_dim, where a config gives it, says the same in features), no bias on
  the output projection;
- first_k_dense_replace dense SwiGLU layers, then DeepSeek-V3's experts: sigmoid
  scores, chosen by score + expert_bias among the topk_group best of n_group groups (a
  group scored by its best two), weighted by the unbiased scores renormalized whenever
  a token takes more than one expert (the published code renormalizes whatever
  norm_topk_prob says) times routed_scaling_factor, plus num_shared_experts experts'
  width of shared SwiGLU.

Refused where the published code computes what this does not: biases on the output and
feed-forward projections (use_bias), a shared-experts width other than
moe_intermediate_size x num_shared_experts, scores other than sigmoid.

Reference: modeling_bailing_moe_v2.py of inclusionAI/Ling-mini-2.0 (github.com/
inclusionAI/Ling-V2, models/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import glm4_moe

# The published config.json names -> glm4_moe.ModelArgs's.
RENAMED = {
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "use_qkv_bias": "attention_bias",
}


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    # BailingMoeV2Config's defaults (Ling-mini-2.0's shape) where they differ.
    intermediate_size: int = 5120
    moe_intermediate_size: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    head_dim: int | None = 128
    use_qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    # llama.cpp's converter rotates half of each head where a config names no share.
    default_partial_rotary_factor = 0.5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return super().from_config(normalized(config))


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A Ling 2.0 config.json in glm4_moe's field names; refused where it asks for what
    the published model does not compute (see the module docstring)."""
    if config.get("use_bias"):
        raise UnsupportedError(
            "Ling 2.0 with use_bias true (biases on the attention output and feed-forward "
            "projections) is not supported"
        )
    score = config.get("score_function", "sigmoid")
    if score != "sigmoid":
        raise UnsupportedError(
            f"Ling 2.0 with score_function {score!r} is not supported (sigmoid: the "
            "published code scores experts by sigmoid whatever the config says)"
        )
    config = dict(config)
    for old, new in RENAMED.items():
        if old in config:
            config[new] = config.pop(old)
    if config.get("n_shared_experts") is None:
        config["n_shared_experts"] = 0 if "n_shared_experts" in config else 1
    width = config.get("moe_intermediate_size", 512) * config["n_shared_experts"]
    shared = config.get("moe_shared_expert_intermediate_size")
    if shared is not None and config["n_shared_experts"] and shared != width:
        raise UnsupportedError(
            f"Ling 2.0 with moe_shared_expert_intermediate_size {shared} is not supported: "
            f"the published shared experts are moe_intermediate_size x num_shared_experts "
            f"({width}) wide"
        )
    config["norm_topk_prob"] = config.get("num_experts_per_tok", 8) > 1
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("rotary_dim"):  # Ling-1T names the rotated width, not its share
        config["partial_rotary_factor"] = config["rotary_dim"] / head_dim
    return config


class Model(glm4_moe.Model):
    """GLM-4.5 MoE's model, under this family's name."""
