"""JetMoE's Hugging Face folders at the loader edge (llama.cpp has no converter for the
family): each layer's stacked experts split into llmrun's one module per expert, as views
of the file's tensors.

The attention's mixture (self_attention.experts) holds input_linear [experts, heads *
kv_channels, hidden] and output_linear [experts, hidden, heads * kv_channels], split into
input_linear.N and output_linear.N; the feed-forward holds input_linear [experts, 2 *
intermediate, hidden] (gate rows, then up rows, as transformers chunks them) and
output_linear [experts, hidden, intermediate], split into experts.N.{gate,up,down}_proj.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError

MODEL_TYPE = "jetmoe"
_STACKED = re.compile(
    r"(model\.layers\.\d+\.(?:self_attention\.experts|mlp))\.(input|output)_linear\.weight"
)


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Any, weight_type: type
) -> dict:
    """A folder's (`path`'s) weights under llmrun's names (see the module's docstring).
    `weight_type` is the loader's Weight."""
    experts = config.get("num_local_experts", 8)
    out = {}
    for name, weight in weights.items():
        match = _STACKED.fullmatch(name)
        if match is None:
            out[name] = weight
            continue
        module, kind = match.groups()
        tensor = weight.tensor
        if tensor.dim() != 3 or tensor.shape[0] != experts:
            raise ModelFormatError(
                f"{path}: {name} has shape {list(tensor.shape)}, not a stack of "
                f"{experts} experts' matrices (num_local_experts)"
            )
        for e in range(experts):
            if module.endswith("experts"):
                out[f"{module}.{kind}_linear.{e}.weight"] = weight_type(tensor[e])
            elif kind == "output":
                out[f"{module}.experts.{e}.down_proj.weight"] = weight_type(tensor[e])
            else:
                gate, up = tensor[e].chunk(2)
                out[f"{module}.experts.{e}.gate_proj.weight"] = weight_type(gate)
                out[f"{module}.experts.{e}.up_proj.weight"] = weight_type(up)
    return out
