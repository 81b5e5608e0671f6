"""Snowflake Arctic GGUFs (arch "arctic") as llama.cpp's converter writes them
(conversion/arctic.py ArcticModel: TextModel's keys and the vocabulary size, whole-head
RoPE, q/k rows permuted as Llama's, which the loader undoes, the experts stacked, the
residual feed-forward as ffn_gate/up/down after ffn_norm, the experts' norm as
ffn_norm_exps), read as llama_model_arctic (src/models/arctic.cpp) reads them: softmax
gating with the top-k renormalized, the experts feed_forward_length wide, the residual
feed-forward as wide as the hidden size, the token embedding as the output matrix where
there is none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, mapped_name, vocab_size

ARCH = MODEL_TYPE = "arctic"
# GGUF layer tensor -> the module in llmrun's layer where it differs from the common
# names (gguf_config); a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    "ffn_norm.weight": "residual_layernorm.weight",
    "ffn_gate.weight": "residual_mlp.w1.weight",
    "ffn_up.weight": "residual_mlp.w3.weight",
    "ffn_down.weight": "residual_mlp.w2.weight",
    "ffn_norm_exps.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{expert}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{expert}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{expert}.w2.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for an arctic layer tensor where it is not one of the common names
    (gguf_config), or None."""
    return mapped_name(gguf_name, {}, _LAYER_NAMES, "model.layers.")


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """llmrun's Arctic config (the remote code's ArcticConfig fields) of an arctic GGUF;
    rope_from_gguf is gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    head_dim = hidden // heads
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{head_dim}; Arctic rotates whole heads (llama.cpp asserts it too)"
        )
    if rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{gg.path}: RoPE scaling {rope['rope_type']!r} in an arctic file is not supported"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "moe_layer_frequency": 1,  # llama.cpp's arctic: experts and residual in every layer
        "parallel_attn_mlp_res": True,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": rope,
    }
