"""Lara Mini folders at the loader edge: the Hub's names (which transformers' conversion
mapping renames at loading, and its save_pretrained writes back) as llmrun's model
(llmrun.models.lara_mini) takes them. Each linear layer's in_proj, rows [q | k | v | z |
b | a] (every head's queries, then every head's keys, ...), is split into Qwen3.5's
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, and its out_norm renamed norm; each
layer's stacked experts (gate_up_proj [E, 2I, D], down_proj [E, D, I]) are split per
expert. llama.cpp has no converter for the family: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.loading import experts

MODEL_TYPE = "lara_mini"
_IN_PROJ = re.compile(r"(model\.layers\.\d+\.linear_attn\.)in_proj\.weight")
_OUT_NORM = re.compile(r"(model\.layers\.\d+\.linear_attn\.)out_norm\.weight")
_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
# LaraMiniConfig's defaults, for a config.json that leaves them out.
_DEFAULTS = {
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "moe_intermediate_size": 512,
}


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Any, weight_type: type
) -> dict:
    """The weights of the folder at `path` under the model's names (see the module
    docstring). `weight_type` is the loader's Weight."""
    sizes = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v}}
    keys = sizes["linear_num_key_heads"] * sizes["linear_key_head_dim"]
    values = sizes["linear_num_value_heads"] * sizes["linear_value_head_dim"]
    heads = sizes["linear_num_value_heads"]
    parts = {
        "in_proj_qkv": 2 * keys + values,
        "in_proj_z": values,
        "in_proj_b": heads,
        "in_proj_a": heads,
    }
    out = {}
    for name, w in weights.items():
        fused, normed = _IN_PROJ.fullmatch(name), _OUT_NORM.fullmatch(name)
        if normed:
            out[normed.group(1) + "norm.weight"] = w
        elif fused:
            tensor = w.tensor
            if tensor.dim() != 2 or tensor.shape[0] != sum(parts.values()):
                raise ModelFormatError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}; the config implies "
                    f"{sum(parts.values())} rows (q, k, v, z, b, a)"
                )
            for part, rows in zip(parts, tensor.split(list(parts.values())), strict=True):
                out[f"{fused.group(1)}{part}.weight"] = weight_type(rows)
        else:
            out[name] = w
    hidden = config["hidden_size"]
    return experts.split_stacked(
        out, _STACKED_EXPERTS, hidden, sizes["moe_intermediate_size"], weight_type
    )


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a Lara Mini config.json-style dict keep keys and values (its
    sliding and full ones); None for another family."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind != "linear_attention" for kind in kinds)
    # LaraMiniConfig's default pattern: linear, sliding, linear, full, sliding, repeated
    return sum(i % 5 in (1, 3, 4) for i in range(int(config["num_hidden_layers"])))
