"""Grok GGUFs (arch "grok") as llama.cpp's converter writes them (conversion/grok.py
GrokModel: TextModel's keys, the experts stacked, the soft-caps, the expert width
moe_intermediate_size, attention.output_scale, embedding_scale and logit_scale; q/k rows
as they are for its NEOX RoPE), read as llama_model_grok (src/models/grok.cpp) reads them:
Grok-1's multipliers and soft-caps where a key is absent, softmax gating with the top-k
renormalized, a dense feed-forward beside the experts where the file has one, the token
embedding as the output matrix where there is none. Also Grok-2's Hugging Face folders
(Grok1ForCausalLM), whatever model_type their config.json says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, mapped_name, vocab_size

ARCH = MODEL_TYPE = "grok"
HF_ARCHITECTURES = ("Grok1ForCausalLM", "GrokForCausalLM")  # the converter's
# GGUF layer tensor -> llmrun's module (Grok-2's keys); a stack of experts names each
# expert's with an {expert} field.
_LAYER_NAMES = {
    "attn_norm.weight": "pre_attn_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output_norm.weight": "post_attn_norm.weight",
    "ffn_norm.weight": "pre_moe_norm.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{expert}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{expert}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{expert}.w2.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "layer_output_norm.weight": "post_moe_norm.weight",  # Grok-1's converters
    "post_ffw_norm.weight": "post_moe_norm.weight",  # Grok-2's
}


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """A Grok folder's config.json with llmrun's model_type (Grok-2's configs do not
    name the family in theirs)."""
    if (config.get("architectures") or [None])[0] in HF_ARCHITECTURES:
        return {**config, "model_type": MODEL_TYPE}
    return config


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a grok layer tensor, or None (the global ones are the common
    names of gguf_config)."""
    return mapped_name(gguf_name, {}, _LAYER_NAMES, "model.layers.")


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """llmrun's Grok config (models/grok.py ModelArgs) of a grok GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
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
    ff = meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or ff  # Grok-1's experts: n_ff
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    dense = [f"blk.{i}.ffn_up.weight" in gg.tensors for i in range(layers)]
    if len(set(dense)) > 1:
        raise UnsupportedError(
            f"{gg.path}: only some layers have a dense feed-forward beside the experts, "
            "which llmrun does not support"
        )
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{head_dim}; Grok rotates whole heads (llama.cpp asserts it too)"
        )
    if rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{gg.path}: RoPE scaling {rope['rope_type']!r} in a grok file is not supported"
        )
    final_cap = meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "moe_intermediate_size": width,
        "residual_moe": dense[0],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        # llama.cpp's defaults (Grok-1's) where a key is absent.
        "embedding_multiplier_scale": meta.get(Keys.LLM.EMBEDDING_SCALE, 78.38367176906169),
        "output_multiplier_scale": meta.get(Keys.LLM.LOGIT_SCALE, 0.5773502691896257),
        "attn_output_multiplier": meta.get(Keys.Attention.OUTPUT_SCALE, 0.08838834764831845),
        "attn_logit_softcapping": meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 30.0),
        "final_logit_softcapping": final_cap or None,
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": rope,
    }
