"""Sarvam MoE (sarvamai/sarvam-30b; the Hub's SarvamMoEForCausalLM, model_type
"sarvam_moe"; llama.cpp converts it to a "bailingmoe2" GGUF, which llmrun reads as Ling
2.0's). transformers builds GLM-4.5 MoE's model from its config (Glm4MoeForCausalLM), and
so does llmrun (llmrun.models.glm4_moe): grouped-query attention from one fused
query_key_value (split at the loader edge, llmrun.loading.bailingmoe), per-head q/k
RMSNorms, RoPE with halves turned; first_k_dense_replace dense SwiGLU layers, then sigmoid
scores chosen by score + expert_bias, weighted by the unbiased scores (renormalized where
norm_topk_prob says so) times routed_scaling_factor, plus shared experts.

Where it differs from Ling 2.0 (llmrun.models.bailing_moe_v2), as SarvamMoEConfig reads a
config: RoPE turns all of each head where a config names no share (Ling: half);
norm_topk_prob is honoured (Ling renormalizes whenever a token takes more than one
expert); heads of 64 and a RoPE base of 8e6 where a config gives none.

Refused where transformers would not run what the config describes: biases on the output
and feed-forward projections (use_bias), scores other than sigmoid, a shared-experts width
other than moe_intermediate_size x num_shared_experts.

Reference: transformers/models/sarvam_moe/configuration_sarvam_moe.py (the config),
models/glm4_moe/modeling_glm4_moe.py (the model), conversion_mapping.py (the Hub's names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import glm4_moe

ROPE_THETA = 8_000_000.0  # SarvamMoEConfig.default_theta
# The Hub's config.json names -> glm4_moe.ModelArgs's (SarvamMoEConfig.attribute_map).
RENAMED = {
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "use_qkv_bias": "attention_bias",
}


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    # SarvamMoEConfig's defaults (sarvam-30b's shape) where they differ from Glm4MoeConfig's.
    intermediate_size: int = 8192
    moe_intermediate_size: int = 1024
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 2.5
    head_dim: int | None = 64
    use_qk_norm: bool = True
    rms_norm_eps: float = 1e-6

    default_partial_rotary_factor = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return super().from_config(normalized(config))


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A Sarvam MoE config.json in glm4_moe's field names, the RoPE base defaulted;
    refused where it asks for what transformers does not compute (module docstring)."""
    if config.get("use_bias"):
        raise UnsupportedError(
            "Sarvam MoE with use_bias true (biases on the attention output and feed-forward "
            "projections) is not supported"
        )
    score = config.get("score_function", "sigmoid")
    if score != "sigmoid":
        raise UnsupportedError(
            f"Sarvam MoE with score_function {score!r} is not supported (its experts are "
            "scored by sigmoid)"
        )
    config = dict(config)
    for old, new in RENAMED.items():
        if old in config:
            config[new] = config.pop(old)
    width = config.get("moe_intermediate_size", 1024) * config.get("n_shared_experts", 1)
    shared = config.get("moe_shared_expert_intermediate_size")
    if shared is not None and shared != width:
        raise UnsupportedError(
            f"Sarvam MoE with moe_shared_expert_intermediate_size {shared} is not supported: "
            f"its shared experts are moe_intermediate_size x num_shared_experts ({width}) wide"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in rope and "rope_theta" not in config:
        config["rope_theta"] = ROPE_THETA
    return config


class Model(glm4_moe.Model):
    """GLM-4.5 MoE's model, under this family's name."""
