"""OPT at the loader edge: the Hub's checkpoints under llmrun's names
(llmrun/models/opt.py). OPTForCausalLM files name the modules model.decoder.*, the
older OPTModel files of facebook/opt-* decoder.* (their lm_head tied, so absent);
llama.cpp has no converter for OPT, so there is no GGUF to read.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "opt"
# After decoder.: what follows the last layer, which llmrun applies as its final norm.
_FINAL = {"final_layer_norm.": "norm.final_layer_norm.", "project_out.": "norm.project_out."}
# A layer's feed-forward, which llmrun holds in its own module.
_FEED_FORWARD = {".fc1.": ".mlp.fc1.", ".fc2.": ".mlp.fc2."}


def hf_name(name: str) -> str:
    """A Hub checkpoint's tensor name under llmrun's: (model.)decoder.X -> model.X, the
    final LayerNorm and project_out under model.norm, a layer's fc1 and fc2 under mlp."""
    rest = name.removeprefix("model.")
    if not rest.startswith("decoder."):
        return name  # lm_head
    rest = rest.removeprefix("decoder.")
    for old, new in _FINAL.items():
        if rest.startswith(old):
            rest = new + rest.removeprefix(old)
            break
    for old, new in _FEED_FORWARD.items():
        rest = rest.replace(old, new)
    return "model." + rest


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub checkpoint's tensors under llmrun's names."""
    return {hf_name(name): w for name, w in weights.items()}
