"""Sarvam MLA (sarvamai/sarvam-105b; the Hub's SarvamMLAForCausalLM, model_type
"sarvam_mla"). transformers builds DeepSeek-V3's model from its config
(DeepseekV3ForCausalLM), and so does llmrun (llmrun.models.deepseek_v3): multi-head
latent attention, a first dense layer, then sigmoid-scored experts chosen by score +
e_score_correction_bias, weighted by the unbiased scores (renormalized) times
routed_scaling_factor, plus a shared expert. The Hub's checkpoint keys are DeepSeek-V3's.

Where it differs from DeepSeek-V3, as SarvamMLAConfig reads a config: its defaults
(sarvam-105b's shape: queries from q_proj without a low-rank bottleneck, one group of
experts, so routing over all of them, one leading dense layer, 128 experts); the Hub
config.json's names num_experts and num_shared_experts; its rope_scaling of type
"deepseek_yarn", which is YaRN. The config's head_dim (the latent plus the rope part, for
vLLM) and q_head_dim are derived values, not read.

Reference: transformers/models/sarvam_mla/configuration_sarvam_mla.py (the config),
models/deepseek_v3/modeling_deepseek_v3.py (the model), models/auto/modeling_auto.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import deepseek_v3

# The Hub's config.json names -> deepseek_v3.ModelArgs's (SarvamMLAConfig.attribute_map).
RENAMED = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}
LEGACY_YARN = "deepseek_yarn"


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    # SarvamMLAConfig's defaults (sarvam-105b's shape) where they differ from
    # DeepseekV3Config's; the four DeepSeek ones a config must give have them too.
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 64
    vocab_size: int = 262144
    intermediate_size: int = 16384
    n_routed_experts: int = 128
    q_lora_rank: int | None = None
    n_group: int | None = 1
    topk_group: int | None = 1
    first_k_dense_replace: int = 1

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        return super().from_config(normalized(config))


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A Sarvam MLA config.json in deepseek_v3's field names, its "deepseek_yarn" RoPE
    scaling as YaRN's rope_parameters (SarvamMLAConfig.__post_init__)."""
    config = dict(config)
    for old, new in RENAMED.items():
        if old in config:
            value = config.pop(old)
            config.setdefault(new, value)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and LEGACY_YARN in (scaling.get("type"), scaling.get("rope_type")):
        del config["rope_scaling"]
        params = {k: v for k, v in scaling.items() if k != "type"}
        config["rope_parameters"] = {**params, "rope_type": "yarn"}
    return config


class Model(deepseek_v3.Model):
    """DeepSeek-V3's model, under this family's name."""
