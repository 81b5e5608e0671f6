"""Falcon checkpoints and GGUFs.

Hugging Face folders name the modules transformer.word_embeddings, transformer.h.N and
transformer.ln_f; hf_weights renames those to llmrun's (model.embed_tokens,
model.layers.N, model.norm) and keeps the rest of each name.

llama.cpp's converter (conversion/falcon.py FalconModel) writes arch "falcon": context
length 2048, embedding and feed-forward (4 * embedding) lengths, block and head counts,
attention.layer_norm_epsilon, no RoPE keys, and each query_key_value's rows regrouped
from num_kv_heads groups (queries, key, value) to all queries, all keys, all values.
src/models/falcon.cpp reads them as the new decoder architecture's parallel block, one
LayerNorm (attn_norm) or two (attn_norm_2 before attention, attn_norm before the
feed-forward), NEOX RoPE on whole heads at base 10000 (or rope.freq_base), no biases
but the LayerNorms'. config_from_gguf describes the file so, and gguf_weights puts the
rows back in num_kv_heads groups (the multi-query layout is one group of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import alibi_families, starcoder2
from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "falcon"
_ONE_NORM = "input_layernorm"  # attn_norm, where it is the only LayerNorm
hf_name = starcoder2.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: _ONE_NORM,
        MODEL_TENSOR.ATTN_NORM_2: "ln_attn",
        MODEL_TENSOR.ATTN_QKV: "self_attention.query_key_value",
        MODEL_TENSOR.ATTN_OUT: "self_attention.dense",
        MODEL_TENSOR.FFN_UP: "mlp.dense_h_to_4h",
        MODEL_TENSOR.FFN_DOWN: "mlp.dense_4h_to_h",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
        MODEL_TENSOR.OUTPUT_NORM: "model.norm",
        MODEL_TENSOR.OUTPUT: "lm_head",
    },
)


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A Falcon folder's weights under llmrun's names (BLOOM's module names)."""
    return alibi_families.hf_weights(weights, alibi_families.BLOOM)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style falcon config from a GGUF's metadata. `rope_from_gguf` is gguf_config's
    reader of the RoPE keys. Refuses biases on the projections, which llama.cpp's falcon
    does not read, and heads of other than embedding / heads features."""
    for name in gg.tensors:
        if name.endswith(".bias") and "norm" not in name:
            raise UnsupportedError(
                f"{gg.path}: tensor {name!r}: llama.cpp's falcon model has no biases on its "
                "projections, so llmrun does not read them from a GGUF"
            )
    config = starcoder2.shape_config(gg, rope_from_gguf)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["head_dim"] * heads != hidden or "partial_rotary_factor" in config["rope_parameters"]:
        raise UnsupportedError(
            f"{gg.path}: a falcon head of {config['head_dim']} features, or RoPE on part of "
            f"it, is not Falcon's (embedding / heads = {hidden // heads}, all rotated)"
        )
    norm_2 = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM_2].format(bid=0) + ".weight"
    return {
        "model_type": MODEL_TYPE,
        "vocab_size": config["vocab_size"],
        "hidden_size": hidden,
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_kv_heads": config["num_key_value_heads"],
        "num_key_value_heads": config["num_key_value_heads"],  # for show's KV cache size
        "new_decoder_architecture": True,
        "parallel_attn": True,
        "num_ln_in_parallel_attn": 2 if norm_2 in gg.tensors else 1,
        "bias": False,
        "alibi": False,
        "ffn_hidden_size": config["intermediate_size"],
        # transformers' Falcon: exact GELU (llama.cpp's graph takes its tanh approximation)
        "activation": "gelu",
        "layer_norm_epsilon": config["layer_norm_eps"],
        "max_position_embeddings": config["max_position_embeddings"],
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
        "rope_parameters": config["rope_parameters"],
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: each query_key_value's rows back in
    num_kv_heads groups, each its queries, key and value (whole rows of blocks where
    quantized); with two LayerNorms, attn_norm as ln_mlp."""
    import torch  # here: list and show stay torch-free

    heads, kv_heads = config["num_attention_heads"], config["num_kv_heads"]
    head_dim = config["hidden_size"] // heads
    if heads % kv_heads:
        raise ModelFormatError(f"{heads} heads do not split into {kv_heads} KV heads' groups")
    per_group = heads // kv_heads
    rows = []
    for g in range(kv_heads):
        rows += range(g * per_group * head_dim, (g + 1) * per_group * head_dim)
        rows += range((heads + g) * head_dim, (heads + g + 1) * head_dim)
        rows += range((heads + kv_heads + g) * head_dim, (heads + kv_heads + g + 1) * head_dim)
    order = torch.tensor(rows)
    two_norms = config["num_ln_in_parallel_attn"] == 2
    out = {}
    for name, w in weights.items():
        if ".query_key_value." in name:
            if w.shape[0] != len(rows):
                raise ModelFormatError(
                    f"attn_qkv of layer {name.split('.')[2]} has {w.shape[0]} rows, but the "
                    f"metadata implies {len(rows)}"
                )
            w = weight_type(w.tensor[order], w.ggml_type, w.shape)
        if two_norms:
            name = name.replace(f".{_ONE_NORM}.", ".ln_mlp.")
        out[name] = w
    return out
