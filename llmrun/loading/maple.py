"""Maple GGUFs (arch "maple") as llama.cpp's converter writes them (conversion/maple.py
MapleModel: Qwen3-MoE's keys and names, the experts stacked, the rope dimension count of
partial_rotary_factor, the sliding window and its per-layer pattern, the expert width and
a SwiGLU clamp per layer), read as llama_model_maple (src/models/maple.cpp) reads them:
RoPE on the sliding layers alone (at rope.freq_base_swa where the file has it), every
layer with experts, renormalized top-k weights, an output matrix of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, mapped_name, vocab_size

ARCH = MODEL_TYPE = "maple"
# GGUF layer tensor -> llmrun's module where it differs from the common names
# (gguf_config); a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a maple layer tensor where it is not one of the common names
    (gguf_config), or None."""
    return mapped_name(gguf_name, {}, _LAYER_NAMES, "model.layers.")


def _one_per_layer(gg: GGUFFile, meta: ArchMetadata, key: str, layers: int) -> Any:
    """The value of a key that llama.cpp reads with get_key_or_arr: one for all layers,
    or an array of one per layer (which llmrun takes when they are all the same)."""
    value = meta.require(key)
    if isinstance(value, list):
        if len(value) != layers or len(set(value)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(key)} is {value}; llmrun supports one value for "
                f"all {layers} layers"
            )
        value = value[0]
    return value


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """llmrun's Maple config (models/maple.py ModelArgs) of a maple GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    if "output.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: no output.weight; a maple file holds its output matrix "
            "(llama.cpp cannot run it without one either)"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    pattern = meta.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)} should hold one "
            f"flag for each of the {layers} layers"
        )
    limit = _one_per_layer(gg, meta, Keys.LLM.SWIGLU_CLAMP_EXP, layers)
    if limit <= 1e-6:  # llama.cpp's: no clamp, which Maple's experts always have
        raise UnsupportedError(f"{gg.path}: Maple without its SwiGLU clamp is not supported")
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{gg.path}: RoPE scaling {rope['rope_type']!r} in a maple file is not supported"
        )
    # Only the sliding layers turn, at their own base where the file gives one.
    rope["rope_theta"] = meta.get(Keys.Rope.FREQ_BASE_SWA, rope["rope_theta"])
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _one_per_layer(
            gg, meta, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, layers
        ),
        "norm_topk_prob": True,
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern],
        "swiglu_limit": limit,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": False,
        "rope_parameters": rope,
    }
