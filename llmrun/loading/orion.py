"""Orion GGUFs (arch "orion") as llama.cpp's converter writes them (conversion/orion.py
OrionModel: its own keys, the context from max_sequence_length, the LayerNorm's epsilon
as attention.layer_norm_epsilon, no RoPE keys, so llama.cpp's base 10000 and whole heads;
q/k rows as they are for its NEOX RoPE), read as src/models/orion.cpp and
llama_model_orion::load_arch_hparams read them: the epsilon and the output matrix
required, LayerNorms with biases, no biases on the projections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = MODEL_TYPE = "orion"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (OrionConfig's fields) of an orion GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    if "output.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: no output.weight; an orion file holds its output matrix "
            "(llama.cpp cannot run it without one either)"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    head_dim = hidden // heads
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": False,
    }
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{head_dim}; Orion rotates whole heads (llama.cpp asserts it too)"
        )
    config["rope_parameters"] = rope
    return config
