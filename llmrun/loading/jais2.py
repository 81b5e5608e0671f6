"""Jais 2 GGUFs (arch "jais2") as llama.cpp's converter writes them (conversion/jais.py
Jais2Model: TextModel's keys, the LayerNorm's epsilon as attention.layer_norm_epsilon,
the rope dimension count of whole heads, q/k rows as they are for llama.cpp's NEOX RoPE),
read as src/models/jais2.cpp reads them: the epsilon required, biases on every norm,
projection and feed-forward matrix, the output matrix tied to the embedding where the
file has none, and whole heads rotated (its graph asserts n_rot == the head size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "jais2"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (Jais2Config's fields) of a jais2 GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "layer_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "max_position_embeddings": context,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        # llama.cpp's loader requires every bias (jais2.cpp load_arch_tensors).
        "attention_bias": True,
        "mlp_bias": True,
    }
    missing = [
        name
        for name in ("blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_up.bias")
        if name not in gg.tensors
    ]
    if missing:
        raise ModelFormatError(
            f"{gg.path}: a jais2 file holds the biases of its projections; "
            f"{', '.join(missing)} missing"
        )
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{gg.path}: Jais 2 rotates whole heads; a rope dimension count of "
            f"{meta.get(Keys.Rope.DIMENSION_COUNT)} for heads of {head_dim} is not supported"
        )
    config["rope_parameters"] = rope
    return config
