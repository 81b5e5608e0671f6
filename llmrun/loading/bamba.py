"""IBM Bamba's Hugging Face checkpoints (model_type "bamba") at the loader edge: their
tensors under the names of granitemoehybrid.py's model, which computes Bamba
(llmrun/models/bamba.py). llama.cpp's converter writes Bamba as a "granitehybrid" GGUF
(conversion/granite.py GraniteHybridModel), which llmrun/loading/granitehybrid.py reads.
"""

from __future__ import annotations

import re
from typing import Any

MODEL_TYPE = "bamba"
# Bamba's module names -> granitemoehybrid's (whole name parts).
_RENAMES = {
    "feed_forward": "mlp",
    "pre_ff_layernorm": "post_attention_layernorm",
    "final_layernorm": "norm",
}
_PART = re.compile(r"(?<![^.])(" + "|".join(_RENAMES) + r")(?=\.)")


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Bamba checkpoint's weights (any values) under granitemoehybrid's names: a
    layer's feed_forward as mlp, pre_ff_layernorm as post_attention_layernorm, the
    model's final_layernorm as norm."""
    return {_PART.sub(lambda m: _RENAMES[m.group(1)], key): w for key, w in weights.items()}


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a bamba config.json-style dict cache keys and values (those in
    attn_layer_indices), None for other models (llmrun.loading.inspect)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    return len(config.get("attn_layer_indices") or [])
