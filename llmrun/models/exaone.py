"""EXAONE 3.0 and 3.5, and EXAONE Deep (LG AI Research; llama.cpp's "exaone" GGUFs):
Llama's math under other config and checkpoint names. Its config.json names the layer
count num_layers, the RMSNorm epsilon layer_norm_epsilon and the activation
activation_function, and takes a RoPE base of 500000 and 8 KV heads where it gives
none; its checkpoints keep GPT-2's module names (transformer.h.N.attn.attention.q_proj,
...), which the loader renames to Llama's (llmrun/loading/exaone.py).

Reference: transformers/models/exaone/modular_exaone.py (ExaoneConfig, run by
LlamaForCausalLM) and the "exaone" renamings in transformers/conversion_mapping.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.models import llama
from llmrun.models.base import args_from_config

# ExaoneConfig.attribute_map: the checkpoints' field names -> Llama's.
CONFIG_ALIASES = {
    "num_layers": "num_hidden_layers",
    "layer_norm_epsilon": "rms_norm_eps",
    "activation_function": "hidden_act",
}
DEFAULT_ROPE_THETA = 500000.0  # ExaoneConfig.default_theta


@dataclass
class ModelArgs(llama.ModelArgs):
    # ExaoneConfig's defaults where they differ from Llama's.
    num_key_value_heads: int | None = 8
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = canonical_config(config)
        # An explicit null num_key_value_heads is the head count (ExaoneConfig), not 8.
        return args_from_config(cls, config, nullable=("num_key_value_heads",))


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with Llama's field names for EXAONE's aliases and ExaoneConfig's RoPE
    base where it gives none."""
    config = dict(config)
    for alias, name in CONFIG_ALIASES.items():
        if alias in config:
            config.setdefault(name, config.pop(alias))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in rope:
        config.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    return config


# Llama's model as it is (and the native decode step that takes Llama's layers).
Model = llama.Model
