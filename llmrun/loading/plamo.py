"""PLaMo-13B at the loader edge: the Hub's folders (PlamoForCausalLM), and "plamo" GGUFs as
llama.cpp's converter writes them (conversion/plamo.py PlamoModel) and llama.cpp reads
them (src/models/plamo.cpp).

The folders' "model.layers.layers.N." is llmrun's "model.layers.N.", their query heads
take the key/value heads in turn and the converter reorders the query rows and o_proj's
columns into groups, as ggml broadcasts them (shuffle_attn_q_weight,
shuffle_attn_output_weight, written for PLaMo-13B's 40 heads of 128 in 5 groups);
llmrun reorders a folder's the same way, for any size (GGUFs hold them so already).
The file's head_count_kv is the key/value heads (the converter writes 5, PLaMo-13B's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name, mapped_name, vocab_size

ARCH = MODEL_TYPE = "plamo"
_HUB_LAYERS = "model.layers.layers."
_ROTARY = "rotary_emb.inv_freq"  # the Hub's RoPE table, which the model computes

GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight": "model.embed_tokens.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + ".weight": "model.norm.weight",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight": "lm_head.weight",
}
LAYER_NAMES = {
    layer_name(MODEL_TENSOR.ATTN_NORM) + ".weight": "norm.weight",
    layer_name(MODEL_TENSOR.ATTN_Q) + ".weight": "self_attn.q_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_K) + ".weight": "self_attn.k_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_V) + ".weight": "self_attn.v_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_OUT) + ".weight": "self_attn.o_proj.weight",
    layer_name(MODEL_TENSOR.FFN_GATE) + ".weight": "mlp.gate_proj.weight",
    layer_name(MODEL_TENSOR.FFN_UP) + ".weight": "mlp.up_proj.weight",
    layer_name(MODEL_TENSOR.FFN_DOWN) + ".weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key of a plamo GGUF tensor, or None if it is not one."""
    return mapped_name(gguf_name, GLOBAL_NAMES, LAYER_NAMES, "model.layers.")


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Hub folder's weights under llmrun's keys, without the RoPE tables, the query rows
    and o_proj's columns grouped by key/value head (the converter's shuffles)."""
    heads = config["num_attention_heads"]
    shared = config.get("n_shared_head", 8)
    if heads % shared:
        raise ModelFormatError(f"PLaMo's {heads} heads do not share key/value heads {shared} each")
    groups, dim = heads // shared, config["hidden_size"] // heads
    out = {}
    for name, w in weights.items():
        if name.endswith(_ROTARY):
            continue
        if name.startswith(_HUB_LAYERS):
            name = name.replace(_HUB_LAYERS, "model.layers.", 1)
        if name.endswith("self_attn.q_proj.weight"):
            # rows [shared, groups, dim] -> [groups, shared, dim]
            t = w.tensor
            w = weight_type(t.reshape(shared, groups, dim, -1).transpose(0, 1).reshape(t.shape))
        elif name.endswith("self_attn.o_proj.weight"):
            t = w.tensor  # columns, as the rows above
            w = weight_type(t.reshape(-1, shared, groups, dim).transpose(1, 2).reshape(t.shape))
        out[name] = w
    return out


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The config.json-style dict of a plamo GGUF, as llama.cpp reads it (whole-head RoPE;
    rope_from_gguf: gguf_config._rope_from_gguf)."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    if not kv_heads or heads % kv_heads:
        raise ModelFormatError(f"{gg.path}: {heads} attention heads in {kv_heads} groups")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "n_shared_head": heads // kv_heads,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "rope_parameters": rope_from_gguf(gg, meta, hidden // heads, context),
    }
