"""PLM GGUFs (arch "plm") as llama.cpp's converter writes them (conversion/plm.py
PLMModel: TextModel's keys, the KV LoRA rank, key length qk_nope + qk_rope, value length,
rope dimension count; DeepSeek-V2's tensor names with kv_b_proj whole as attn_kv_b, no
output matrix), read as src/models/plm.cpp reads them: multi-head latent attention without
a query bottleneck, every layer dense with a squared-ReLU feed-forward, the token embedding
as the output matrix. Tensor names are deepseek2's (llmrun/loading/deepseek2.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = MODEL_TYPE = "plm"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """llmrun's PLM config (DeepSeek-V2's MLA fields) of a plm GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    if "output.weight" in gg.tensors:
        raise ModelFormatError(
            f"{gg.path}: a plm file has no output matrix (llama.cpp reads the token embedding "
            "and refuses a file with more tensors)"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    qk_head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    rope_dim = meta.require(Keys.Rope.DIMENSION_COUNT)
    if not 0 < rope_dim < qk_head_dim:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rope_dim}, but keys have "
            f"{qk_head_dim} features: no part without RoPE is left"
        )
    rope = rope_from_gguf(gg, meta, rope_dim, context)
    if rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{gg.path}: RoPE scaling {rope['rope_type']!r} in a plm file is not supported"
        )
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "first_k_dense_replace": layers,  # every layer dense, as deepseek2's reader says it
        "num_attention_heads": heads,
        "vocab_size": vocab_size(gg, meta),
        "max_position_embeddings": context,
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,  # llama.cpp normalizes the latent with it too
        "kv_lora_rank": meta.require(Keys.Attention.KV_LORA_RANK),
        "q_lora_rank": None,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": meta.get(Keys.Attention.VALUE_LENGTH) or hidden // heads,
        "rope_interleave": True,  # llama.cpp's "normal" RoPE: adjacent pairs, unpermuted
        "tie_word_embeddings": True,
        "rope_parameters": rope,
    }
