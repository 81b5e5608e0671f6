"""MiniCPM5-MoE's Hugging Face folders at the loader edge (llama.cpp's converter writes no
GGUF of it: only MiniCPM5's pre-tokenizer is known there).

The Hub's checkpoints name the query and gate projection self_attn.q_proj and hold one
key per expert, as llmrun's model does; what transformers 5 saves names it q_gate_proj
(its conversion_mapping.py rename) and may stack the experts, which hf_weights undoes.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.loading import experts

MODEL_TYPE = "minicpm5_moe"
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")
_TRANSFORMERS_NAMES = {".self_attn.q_gate_proj.": ".self_attn.q_proj."}


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A folder's weights under the Hub's keys: transformers' q_gate_proj renamed, stacked
    experts split per expert. `weight_type` is the loader's Weight."""
    out = {}
    for name, w in weights.items():
        for old, new in _TRANSFORMERS_NAMES.items():
            name = name.replace(old, new)
        out[name] = w
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 512)
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)
