"""IBM Bamba (Bamba-9B, v2; BambaForCausalLM): the Mamba-2 and attention hybrid that
Granite 4.0-H grew from, computed by granitemoehybrid.py's model: Mamba-2 layers with a
few attention layers among them (attn_layer_indices), each followed by a dense SwiGLU,
the attention turning the first half of each head by RoPE (transformers fixes
partial_rotary_factor at 0.5 for every Bamba checkpoint), and no muP multipliers.

config.json names the sizes as BambaConfig does (mapped onto granitemoehybrid's fields
here); the checkpoints' feed_forward, pre_ff_layernorm and final_layernorm take
granitemoehybrid's names at the loader edge (llmrun/loading/bamba.py).

Reference: transformers/models/bamba/modeling_bamba.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.models import granitemoehybrid
from llmrun.models.base import args_from_config

PARTIAL_ROTARY_FACTOR = 0.5  # BambaConfig's, whatever config.json says


@dataclass
class ModelArgs(granitemoehybrid.ModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        layers = config["num_hidden_layers"]
        attending = config.get("attn_layer_indices") or []
        if any(not isinstance(i, int) or not 0 <= i < layers for i in attending):
            raise ModelFormatError(
                f"attn_layer_indices {attending} name layers outside the {layers} layers"
            )
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        mapped = {
            **config,
            "layer_types": ["attention" if i in attending else "mamba" for i in range(layers)],
            "position_embedding_type": "rope",
            "num_local_experts": 0,
            "shared_intermediate_size": config["intermediate_size"],
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "logits_scaling": 1.0,
            "attention_multiplier": head_dim**-0.5,
        }
        args = args_from_config(cls, mapped)
        args.rope_parameters["partial_rotary_factor"] = PARTIAL_ROTARY_FACTOR
        return args


Model = granitemoehybrid.Model
