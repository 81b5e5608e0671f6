"""Ergo folders at the loader edge. The Hub's checkpoints (Amazon-FMR/Ergo), and what
transformers saves, keep the names of Ergo's training framework (tok_embeddings,
layers.N.attention.wqkv, feed_forward.gate_kernel, ...); they are renamed to transformers'
module names as its conversion_mapping.py does ("ergo"), the router's and the shared
expert's [in, out] matrices transposed. The routed experts, stacked [E, in, out]
(experts.up_proj, experts.down_proj) with their norms stacked [E, hidden]
(experts.post_expert_norm), are split into llmrun's modules, one per expert. A folder
without an output matrix is refused: Ergo never ties it to the embeddings. llama.cpp has
no converter for Ergo: folders only.
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError

MODEL_TYPE = "ergo"
_RENAMES = tuple(
    (re.compile(pattern), new)
    for pattern, new in (
        (r"^tok_embeddings\.", "model.embed_tokens."),
        (r"^norm\.", "model.norm."),
        (r"^output\.", "lm_head."),
        (r"^layers\.", "model.layers."),
        (r"\.attention_norm\.", ".input_layernorm."),
        (r"\.post_attention_norm\.", ".post_attention_layernorm."),
        (r"\.ffn_norm\.", ".pre_feedforward_layernorm."),
        (r"\.post_ffn_norm\.", ".post_feedforward_layernorm."),
        (r"\.post_attention_residual\.scale$", ".attention_residual_gate.weight"),
        (r"\.post_ffn_residual\.scale$", ".feedforward_residual_gate.weight"),
        (r"\.attention\.wqkv\.", ".self_attn.qkv_proj."),
        (r"\.attention\.wo\.", ".self_attn.o_proj."),
        (r"\.attention\.(q|k)_norm\.", r".self_attn.\1_norm."),
        (r"\.feed_forward\.up\.", ".mlp.up_proj."),
        (r"\.feed_forward\.down\.", ".mlp.down_proj."),
        (r"\.feed_forward\.router_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.feed_forward\.(up|down)_proj$", r".mlp.experts.\1_proj"),
        (r"\.feed_forward\.expert_output_norm\.scale$", ".mlp.experts.post_expert_norm.weight"),
        (r"\.feed_forward\.shared_expert_output_norm\.scale$", ".mlp.shared_experts.norm.weight"),
    )
)
# Stored [in, out]: transposed to the [out, in] of a Linear.
_TRANSPOSED = tuple(
    (re.compile(pattern), new)
    for pattern, new in (
        (r"\.feed_forward\.gate_kernel$", ".mlp.gate.linear.weight"),
        (r"\.feed_forward\.shared_(up|down)_proj$", r".mlp.shared_experts.\1_proj.weight"),
    )
)
# transformers' stacks of a layer's routed experts, and llmrun's per-expert names.
_STACKED = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(up_proj|down_proj|post_expert_norm\.weight)"
)
_PER_EXPERT = {"up_proj": "up_proj.weight", "down_proj": "down_proj.weight"}


def hf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """The checkpoint's weights under llmrun's names (see the module's docstring).
    `weight_type` is the loader's Weight."""
    out = {}
    for name, w in weights.items():
        for pattern, new in _TRANSPOSED:
            renamed = pattern.sub(new, name)
            if renamed != name:
                name = _renamed(renamed)
                if w.tensor.dim() != 2:
                    raise ModelFormatError(f"{name} has shape {list(w.shape)}, not a matrix")
                w = weight_type(w.tensor.t().contiguous())
                break
        else:
            name = _renamed(name)
        stack = _STACKED.fullmatch(name)
        if stack is None:
            out[name] = w
            continue
        prefix, part = stack.groups()
        norm = part == "post_expert_norm.weight"
        if w.tensor.dim() != (2 if norm else 3):
            raise ModelFormatError(f"{name} has shape {list(w.shape)}, not a stack of experts")
        for e in range(w.tensor.shape[0]):
            # [in, out] -> [out, in], in memory order for the products
            expert = w.tensor[e] if norm else w.tensor[e].t().contiguous()
            out[f"{prefix}.{e}.{'norm.weight' if norm else _PER_EXPERT[part]}"] = weight_type(
                expert
            )
    if "lm_head.weight" not in out:
        raise ModelFormatError(
            "an Ergo checkpoint without its output matrix (output.weight): Ergo does not tie "
            "it to the embeddings"
        )
    return out


def _renamed(name: str) -> str:
    for pattern, new in _RENAMES:
        name = pattern.sub(new, name)
    return name
