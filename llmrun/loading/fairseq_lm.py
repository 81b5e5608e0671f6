"""BioGPT's and XGLM's checkpoints at the loader edge: fairseq's decoder-only language
models, run by llmrun's OPT model (llmrun/models/opt.py), their tensors renamed to OPT's.
BioGPT's files name the modules biogpt.embed_tokens, biogpt.layers.N, biogpt.layer_norm
and output_projection; XGLM's model.embed_tokens, model.layers.N, model.layer_norm and
lm_head, and older ones carry the sinusoidal table's placeholder
(model.embed_positions._float_tensor), which is not a weight. llama.cpp has no converter
for either, so there is no GGUF to read.
"""

from __future__ import annotations

from typing import Any

from llmrun.loading import opt

BIOGPT, XGLM = "biogpt", "xglm"
MODEL_TYPES = (BIOGPT, XGLM)
# Each family's prefix of the decoder's modules, and its output matrix's name.
_NAMES = {BIOGPT: ("biogpt.", "output_projection."), XGLM: ("model.", "lm_head.")}


def hf_name(name: str, model_type: str) -> str:
    """A Hub checkpoint's tensor name under llmrun's: the decoder's X as OPT's decoder.X,
    its final layer_norm as OPT's final_layer_norm, the output matrix as lm_head."""
    prefix, head = _NAMES[model_type]
    if name.startswith(head):
        return "lm_head." + name.removeprefix(head)
    rest = name.removeprefix(prefix)
    if rest.startswith("layer_norm."):
        rest = "final_layer_norm." + rest.removeprefix("layer_norm.")
    return opt.hf_name("decoder." + rest)


def hf_weights(weights: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Hub checkpoint's tensors under llmrun's names, without XGLM's sinusoidal
    table (computed, not stored)."""
    return {
        hf_name(name, model_type): w
        for name, w in weights.items()
        if not (model_type == XGLM and ".embed_positions." in name)
    }
