"""Persimmon at the loader edge: the Hub's checkpoints (model.embed_tokens,
model.layers.N.self_attn.*, model.final_layernorm) under llmrun's GPT-NeoX names
(llmrun/models/gpt_neox.py runs the model). llama.cpp has no converter for Persimmon, so
there is no GGUF to read.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "persimmon"
# Persimmon's module names -> GPT-NeoX's in llmrun.
_NAMES = {
    "model.embed_tokens.": "model.embed_in.",
    "model.final_layernorm.": "model.final_layer_norm.",
}


def hf_name(name: str) -> str:
    """A Hub checkpoint's tensor name under llmrun's."""
    for old, new in _NAMES.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name.replace(".self_attn.", ".attention.")


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub checkpoint's tensors under llmrun's names."""
    return {hf_name(name): w for name, w in weights.items()}
