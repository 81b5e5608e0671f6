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
from llmrun.loading.gguf_io import GGUFFile

ARCH = MODEL_TYPE = "jais2"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (Jais2Config's fields) of a jais2 GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{ARCH}.{name}"
        if full not in gg.metadata:
            if required:
                raise ModelFormatError(f"{gg.path}: metadata {full!r} is missing")
            return default
        return gg.metadata[full]

    def field(template: str) -> str:
        return template.removeprefix("{arch}.")

    hidden = key(field(Keys.LLM.EMBEDDING_LENGTH), required=True)
    heads = key(field(Keys.Attention.HEAD_COUNT), required=True)
    head_dim = key(field(Keys.Attention.KEY_LENGTH)) or hidden // heads
    context = key(field(Keys.LLM.CONTEXT_LENGTH), required=True)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": key(field(Keys.LLM.FEED_FORWARD_LENGTH), required=True),
        "num_hidden_layers": key(field(Keys.LLM.BLOCK_COUNT), required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": key(field(Keys.Attention.HEAD_COUNT_KV), heads),
        "head_dim": head_dim,
        "layer_norm_eps": key(field(Keys.Attention.LAYERNORM_EPS), required=True),
        "max_position_embeddings": context,
        "vocab_size": key(field(Keys.LLM.VOCAB_SIZE)) or (len(tokens) if tokens else None),
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
    rope = rope_from_gguf(gg, key, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{gg.path}: Jais 2 rotates whole heads; a rope dimension count of "
            f"{key(field(Keys.Rope.DIMENSION_COUNT))} for heads of {head_dim} is not supported"
        )
    config["rope_parameters"] = rope
    return config
