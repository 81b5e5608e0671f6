"""MiniCPM3 GGUFs (arch "minicpm3") as llama.cpp's converter writes them
(conversion/minicpm.py MiniCPM3Model) and src/models/minicpm3.cpp reads them.

The converter writes only the shapes: context, embedding, feed-forward and layer counts,
head counts, the norms' eps, q_lora_rank and kv_lora_rank, the key width (qk_nope +
qk_rope) as attention.key_length and the rotated width as rope.dimension_count; LongRoPE's
factors as the rope_factors_long/short tensors; the tensors under DeepSeek-V2's names,
rows as they are. It writes no RoPE base (llama.cpp's default, 1e4, is MiniCPM3-4B's),
no value width (llama.cpp's default: embedding_length / head_count) and none of
MiniCPM's three scalars, which llama.cpp's graph fixes at MiniCPM3-4B's values: the
embeddings times 12, each sublayer's output times 1.4 / sqrt(layers), the final hidden
state times 256 / embedding_length. Its graph normalizes the query and key/value
latents with the layers' eps (transformers: 1e-6), and its output matrix is the
embedding's where the file has no output.weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

# gguf-py's MODEL_ARCH.MINICPM3
ARCH = MODEL_TYPE = "minicpm3"
# llama_model_minicpm3::graph's constants: scale_embd, scale_depth, n_embd_base.
SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 12.0, 1.4, 256


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a minicpm3 tensor: DeepSeek-V2's names (deepseek2.hf_name)."""
    return deepseek2.hf_name(gguf_name)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config of a minicpm3 GGUF, read as llama.cpp reads it (which keys it
    requires, its defaults). `rope_from_gguf` is gguf_config's reader of the RoPE keys
    and factor tensors."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.HEAD_COUNT)} is {heads!r}; llmrun needs one number"
        )
    key_width = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or key_width
    if not 0 < rotated < key_width or rotated % 2:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rotated}, but a key of "
            f"{key_width} features needs an even part of it rotated and a part not"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    rope = rope_from_gguf(gg, meta, rotated, context)
    if rope["rope_type"] not in ("default", "longrope"):
        raise UnsupportedError(
            f"{path}: MiniCPM3 with {rope['rope_type']} RoPE scaling is not supported "
            "(none, or LongRoPE's factor tensors)"
        )
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "q_lora_rank": meta.require(Keys.Attention.Q_LORA_RANK),
        "kv_lora_rank": meta.require(Keys.Attention.KV_LORA_RANK),
        "qk_nope_head_dim": key_width - rotated,
        "qk_rope_head_dim": rotated,
        "v_head_dim": meta.get(Keys.Attention.VALUE_LENGTH) or hidden // heads,
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "scale_emb": SCALE_EMB,
        "scale_depth": SCALE_DEPTH,
        "dim_model_base": DIM_MODEL_BASE,
        "rope_parameters": rope,
    }


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: kv_b_proj in floats where the file holds
    blocks (deepseek2.gguf_weights; every layer is dense)."""
    dense = {**config, "first_k_dense_replace": config["num_hidden_layers"]}
    return deepseek2.gguf_weights(weights, dense, weight_type)
