"""MiniCPM 1/2/4 (MiniCPM-1B/2B, MiniCPM4-0.5B/8B; MiniCPMForCausalLM, the Hub's remote
code; llama.cpp's "minicpm" GGUFs): Llama with muP scalars, the embeddings times
scale_emb, each sublayer's output times scale_depth / sqrt(num_hidden_layers) before it
joins the residual stream, the final hidden state (so the logits) divided by
hidden_size / dim_model_base; MiniCPM4 turns RoPE by LongRoPE's short or long factors,
chosen once by the model's context (max_position_embeddings, the long factors where it
exceeds original_max_position_embeddings) for every position, not by a sequence's length.

These are Granite's multipliers under other names, so the model is Granite's
(granite.py) with embedding_multiplier = scale_emb, residual_multiplier = scale_depth /
sqrt(num_hidden_layers), logits_scaling = hidden_size / dim_model_base and
attention_multiplier = head_dim^-0.5 (MiniCPM's scores are Llama's).

Reference: openbmb's modeling_minicpm.py (trust_remote_code; not in transformers), whose
math transformers/models/granite/modeling_granite.py computes with the values above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmrun.errors import UnsupportedError
from llmrun.models import granite
from llmrun.models.base import args_from_config

# MiniCPMConfig's defaults for a config.json that leaves a scalar out.
SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 1.0, 1.0, 1


@dataclass
class ModelArgs(granite.ModelArgs):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("num_experts"):
            raise UnsupportedError(
                "MiniCPM with experts (MiniCPM-MoE, num_experts) is not supported; "
                "llmrun runs the dense MiniCPM models"
            )
        args = args_from_config(cls, config)
        channels = config.get("kv_channels")
        if channels is not None and channels != args.head_dim:
            # MiniCPMForCausalLM's heads are hidden_size / heads wide; VoxCPM's MiniCPM-4
            # reads kv_channels. Which one a checkpoint means is not for llmrun to guess.
            raise UnsupportedError(
                f"MiniCPM config: kv_channels {channels} is not hidden_size / "
                f"num_attention_heads ({args.head_dim}), which llmrun does not support"
            )
        args.embedding_multiplier = config.get("scale_emb", SCALE_EMB)
        depth = config.get("scale_depth", SCALE_DEPTH)
        args.residual_multiplier = depth / math.sqrt(args.num_hidden_layers)
        args.logits_scaling = args.hidden_size / config.get("dim_model_base", DIM_MODEL_BASE)
        args.attention_multiplier = args.head_dim**-0.5
        rope = args.rope_parameters
        if rope["rope_type"] == "longrope":
            # MiniCPMLongRoPE fills its table for max_position_embeddings positions at once,
            # with the long factors where that exceeds the original context: every position
            # takes them then, whatever the sequence or cache.
            if args.max_position_embeddings > rope["original_max_position_embeddings"]:
                rope["short_factor"] = rope["long_factor"]
        return args


# Granite's model itself, so that llmrun.quant.decode_step knows it as "granite".
Model = granite.Model
