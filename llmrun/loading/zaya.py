"""ZAYA1 checkpoints at the loader edge: Hugging Face folders (Zyphra/ZAYA1-8B), whose keys
are transformers' module names (its conversion mapping has no "zaya" entry), the experts
stacked as transformers 5 saves them (mlp.experts.gate_up_proj [E, 2I, D], down_proj
[E, D, I]), split here into llmrun's one module per expert. llama.cpp has no converter
for ZAYA: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.loading import experts

MODEL_TYPE = "zaya"
SLIDING = "hybrid_sliding"
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """A ZAYA folder's weights with its stacked experts split."""
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 2048)
    return experts.split_stacked(weights, _STACKED, hidden, width, weight_type)


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (every layer attends), None for the global ones."""
    layers = int(config.get("num_hidden_layers") or 40)
    kinds = config.get("layer_types") or ["hybrid"] * layers
    return [config.get("sliding_window") if kind == SLIDING else None for kind in kinds]
