"""Nemotron GGUFs (arch "nemotron": Nemotron-Mini-4B, Minitron) as llama.cpp's converter
writes them (conversion/nemotron.py NemotronModel: TextModel's keys, the LayerNorm's
epsilon as attention.layer_norm_epsilon, the rope dimension count of its partial RoPE,
linear scaling where the config has a factor, each LayerNorm1P weight stored as 1 + w,
q/k rows as they are for llama.cpp's NEOX RoPE), read as src/models/nemotron.cpp and
llama_model_nemotron::load_arch_hparams read them: the epsilon required, the output
matrix required (never tied), biases on the norms always and on the projections where
the file has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "nemotron"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (NemotronConfig's fields) of a nemotron GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    if "output.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: no output.weight; a nemotron file holds its output matrix "
            "(llama.cpp cannot run it without one either)"
        )
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
        "norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "max_position_embeddings": context,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens else None),
        "tie_word_embeddings": False,
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in gg.tensors,
    }
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if rope["rope_type"] not in ("default", "linear"):
        raise UnsupportedError(
            f"{gg.path}: Nemotron with {rope['rope_type']} RoPE scaling is not supported "
            "(its converter writes none or linear)"
        )
    # No rope dimension count: llama.cpp turns whole heads (n_rot = the head size), where
    # NemotronConfig's default would turn half of each.
    rope.setdefault("partial_rotary_factor", 1.0)
    config["rope_parameters"] = rope
    return config
