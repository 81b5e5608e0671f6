"""GroveMoE GGUFs (arch "grovemoe") as llama.cpp's converter writes them
(conversion/grovemoe.py GroveMoeModel: Qwen3-MoE's keys and names, the experts stacked,
the adjugate experts stacked as ffn_{gate,up,down}_chexps, expert_feed_forward_length,
expert_chunk_feed_forward_length, experts_per_group and expert_group_scale, the unused
expert_bias left out), read as llama_model_grovemoe (src/models/grovemoe.cpp) reads them:
every layer with experts, renormalized top-k weights, whole-head RoPE. Also GroveMoE's
Hugging Face folders (GroveMoeForCausalLM), whatever model_type their config.json says.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, mapped_name

ARCH = MODEL_TYPE = "grovemoe"
HF_ARCHITECTURES = ("GroveMoeForCausalLM",)
_EXPERT_BIAS = re.compile(r"model\.layers\.\d+\.mlp\.expert_bias")
# GGUF layer tensor -> llmrun's module where it differs from the common names
# (gguf_config); a stack of experts names each expert's with an {expert} field, a stack of
# adjugate experts is split by gguf_weights.
_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
    "ffn_gate_chexps.weight": "mlp.chunk_experts.gate_proj.weight",
    "ffn_up_chexps.weight": "mlp.chunk_experts.up_proj.weight",
    "ffn_down_chexps.weight": "mlp.chunk_experts.down_proj.weight",
}
_CHUNK_STACK = re.compile(r"(model\.layers\.\d+\.mlp\.chunk_experts)\.(\w+_proj)\.weight")


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """A GroveMoE folder's config.json with llmrun's model_type."""
    if (config.get("architectures") or [None])[0] in HF_ARCHITECTURES:
        return {**config, "model_type": MODEL_TYPE}
    return config


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A folder's weights without mlp.expert_bias, which the remote code's forward never
    reads (nor does llama.cpp's converter keep it)."""
    return {k: w for k, w in weights.items() if not _EXPERT_BIAS.fullmatch(k)}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a grovemoe layer tensor where it is not one of the common names
    (gguf_config), or None."""
    return mapped_name(gguf_name, {}, _LAYER_NAMES, "model.layers.")


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """The file's weights with each layer's stacked adjugate experts [groups, rows, cols]
    split into chunk_experts.N (views of the file's bytes). `weight_type` is the loader's
    Weight."""
    out = {}
    for key, w in weights.items():
        match = _CHUNK_STACK.fullmatch(key)
        if match is None:
            out[key] = w
            continue
        if len(w.shape) != 3:
            raise ModelFormatError(
                f"{key}: the adjugate experts have shape {list(w.shape)}, not [groups, rows, "
                "columns]"
            )
        count, rows, cols = w.shape
        stacked = w.tensor.view(count, rows, -1)  # float, or rows of GGML blocks
        for c in range(count):
            name = f"{match.group(1)}.{c}.{match.group(2)}.weight"
            out[name] = weight_type(stacked[c], w.ggml_type, (rows, cols), expert=True)
    return out


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """GroveMoE's fields of the HF-style config that config_from_gguf built (Qwen3-MoE's),
    as llama_model_grovemoe::load_arch_hparams reads them: the expert width, group size
    and adjugate scale required, the adjugate width head_dim where absent; every layer
    with experts, renormalized."""
    path = gg.path
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; GroveMoE rotates whole heads (llama.cpp asserts it too)"
        )
    chunk = meta.get(Keys.LLM.EXPERT_CHUNK_FEED_FORWARD_LENGTH) or config["head_dim"]
    config.update(
        model_type=MODEL_TYPE,
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        experts_per_group=meta.require(Keys.LLM.EXPERTS_PER_GROUP),
        chunk_intermediate_size=chunk,
        expert_group_scale=meta.require(Keys.LLM.EXPERT_GROUP_SCALE),
    )
