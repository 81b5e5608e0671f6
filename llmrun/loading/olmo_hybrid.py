"""OLMo Hybrid folders at the loader edge: the Hub's names (which transformers'
conversion mapping renames at loading, and its save_pretrained writes back) as llmrun's
model (llmrun.models.olmo_hybrid, Qwen3.5's Gated DeltaNet) takes them. In each linear
layer q_proj, k_proj and v_proj are joined, in that order, into in_proj_qkv, and
q_conv1d, k_conv1d and v_conv1d into conv1d (the convolution's channels); g_proj,
a_proj, b_proj, o_proj and o_norm are renamed; attention_layer_norm is the layer's
input_layernorm and feedforward_layer_norm its post_attention_layernorm (in every
layer). llama.cpp has no converter for the family: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError

MODEL_TYPE = "olmo_hybrid"
FULL_EVERY = 4  # OlmoHybridConfig's default pattern (llmrun.models.olmo_hybrid)
_LAYER_NORMS = {
    "attention_layer_norm": "input_layernorm",
    "feedforward_layer_norm": "post_attention_layernorm",
}
_JOINED = {  # the model's tensor: the Hub's, joined along their first dimension
    "in_proj_qkv.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
}
_PARTS = {part: joined for joined, parts in _JOINED.items() for part in parts}
_RENAMED = {
    "g_proj.weight": "in_proj_z.weight",
    "a_proj.weight": "in_proj_a.weight",
    "b_proj.weight": "in_proj_b.weight",
    "o_proj.weight": "out_proj.weight",
    "o_norm.weight": "norm.weight",
}
_NAME = re.compile(r"(model\.layers\.\d+\.)(?:linear_attn\.(.+)|(\w+)\.weight)")


def hf_weights(weights: dict[str, Any], path: Any, weight_type: type) -> dict[str, Any]:
    """The weights of the folder at `path` under the model's names (see the module
    docstring). `weight_type` is the loader's Weight."""
    import torch

    out, parts = {}, {}
    for name, w in weights.items():
        match = _NAME.fullmatch(name)
        layer, linear, norm = match.groups() if match else (None, None, None)
        if linear in _PARTS:
            parts.setdefault((layer, _PARTS[linear]), {})[linear] = w
        elif linear is not None:
            out[f"{layer}linear_attn.{_RENAMED.get(linear, linear)}"] = w
        elif norm in _LAYER_NORMS:
            out[f"{layer}{_LAYER_NORMS[norm]}.weight"] = w
        else:
            out[name] = w
    for (layer, joined), found in parts.items():
        missing = [p for p in _JOINED[joined] if p not in found]
        if missing:
            raise ModelFormatError(f"{path}: {layer}linear_attn.{missing[0]} is missing")
        tensors = [found[p].tensor for p in _JOINED[joined]]
        if any(t.dim() < 2 or t.shape[1:] != tensors[0].shape[1:] for t in tensors):
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ModelFormatError(f"{path}: {layer}linear_attn.{joined} joins shapes {shapes}")
        out[f"{layer}linear_attn.{joined}"] = weight_type(torch.cat(tensors))
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of an OLMo Hybrid config.json-style dict keep keys and values (its
    full-attention ones); None for another family."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind == "full_attention" for kind in kinds)
    layers = int(config["num_hidden_layers"])
    return max(layers // FULL_EVERY, 1)
