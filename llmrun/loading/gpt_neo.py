"""GPT-Neo at the loader edge: the Hub's checkpoints (transformer.wte, wpe,
h.N.attn.attention.q_proj, ..., ln_f; nn.Linear matrices, stored [out, in]) under
llmrun's names (llmrun/models/gpt_neo.py), without the attention's mask buffers older
files hold. llama.cpp has no converter for GPT-Neo, so there is no GGUF to read.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "gpt_neo"
# The Hub's module names (after transformer.) -> llmrun's, GPT-2's.
_HUB_NAMES = {
    "wte.": "model.embed_tokens.",
    "wpe.": "model.position_embeddings.",
    "h.": "model.layers.",
    "ln_f.": "model.norm.",
}
# The attention's causal and window masks, which older checkpoints carry: not weights.
_BUFFERS = (".attn.attention.bias", ".attn.attention.masked_bias")


def hf_name(name: str) -> str:
    """A Hub checkpoint's tensor name under llmrun's."""
    name = name.removeprefix("transformer.")
    for old, new in _HUB_NAMES.items():
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    return name.replace(".attn.attention.", ".attn.")


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Hub checkpoint's tensors under llmrun's names, without the mask buffers."""
    return {hf_name(name): w for name, w in weights.items() if not name.endswith(_BUFFERS)}
