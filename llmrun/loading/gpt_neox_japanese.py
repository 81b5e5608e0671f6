"""GPT-NeoX Japanese at the loader edge: the Hub's checkpoints (gpt_neox_japanese.embed_in,
gpt_neox_japanese.layers.N, gpt_neox_japanese.final_layer_norm, embed_out) under llmrun's
GPT-NeoX names (llmrun/models/gpt_neox.py runs the model). llama.cpp has no converter
for it, so there is no GGUF to read.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "gpt_neox_japanese"
_HUB_PREFIXES = {"gpt_neox_japanese.": "model.", "embed_out.": "lm_head."}


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub checkpoint's tensors under llmrun's names."""
    out = {}
    for name, w in weights.items():
        for old, new in _HUB_PREFIXES.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        out[name] = w
    return out
