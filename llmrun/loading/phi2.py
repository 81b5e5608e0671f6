"""Phi-1, Phi-1.5 and Phi-2 GGUFs (arch "phi2") as llama.cpp's converter writes them
(conversion/phi.py Phi2Model: context, embedding and feed-forward lengths, head counts,
the LayerNorms' epsilon, rope.dimension_count = partial_rotary_factor * head width, no
RoPE base; q/k rows as they are, since llama.cpp turns Phi-2 with NEOX RoPE; separate
attn_q/attn_k/attn_v from transformers' checkpoints, one fused attn_qkv from the
original ones' mixer.Wqkv) and as src/models/phi2.cpp reads them: one LayerNorm before
attention and the feed-forward in parallel, biases everywhere, an output matrix with a
bias of its own, RoPE on the first rope.dimension_count features of each head (all of
them where the key is absent), base 10000 where the file gives none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import starcoder2
from llmrun.loading.gguf_io import GGUFFile

ARCH, MODEL_TYPE = "phi2", "phi"
# llama.cpp's LLM_FFN_GELU: GELU's tanh approximation, transformers' gelu_new.
GELU_TANH = "gelu_new"
_QKV = "self_attn.qkv_proj"  # a fused attn_qkv, until gguf_weights splits it
hf_name = starcoder2.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "input_layernorm",
        MODEL_TENSOR.ATTN_QKV: _QKV,
        MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
        MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
        MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
        MODEL_TENSOR.ATTN_OUT: "self_attn.dense",
        MODEL_TENSOR.FFN_UP: "mlp.fc1",
        MODEL_TENSOR.FFN_DOWN: "mlp.fc2",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
        MODEL_TENSOR.OUTPUT_NORM: "model.final_layernorm",
        MODEL_TENSOR.OUTPUT: "lm_head",
    },
)
_QK_NORMS = tuple(
    TENSOR_NAMES[t].format(bid=0) + ".weight"
    for t in (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)
)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style phi config from a GGUF's metadata. `rope_from_gguf` is gguf_config's
    reader of the RoPE keys. Refuses q/k norms (qk_layernorm), which llama.cpp's phi2 has
    no tensors for, and heads of other than hidden size / heads features."""
    path = gg.path
    for name in _QK_NORMS:
        if name in gg.tensors:
            raise UnsupportedError(
                f"{path}: tensor {name!r}: llama.cpp's phi2 model has no q/k norms "
                "(qk_layernorm), so llmrun does not read them from a GGUF"
            )
    config = starcoder2.shape_config(gg, rope_from_gguf)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["head_dim"] * heads != hidden:
        raise UnsupportedError(
            f"{path}: a phi2 head of {config['head_dim']} features is not hidden size / "
            f"heads ({hidden} / {heads}), the only one Phi has"
        )
    # Without rope.dimension_count llama.cpp turns whole heads (transformers' default,
    # a half, is not the file's).
    config["rope_parameters"].setdefault("partial_rotary_factor", 1.0)
    config.update(
        model_type=MODEL_TYPE,
        hidden_act=GELU_TANH,
        tie_word_embeddings=False,
        qk_layernorm=False,
    )
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: a fused attn_qkv (weight and bias; rows of
    queries, keys, values, as llama.cpp's build_qkv splits them) as q_proj, k_proj and
    v_proj, each a view of the file's rows (whole blocks where quantized)."""
    head_dim = config["head_dim"]
    rows = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )
    out = {}
    for name, w in weights.items():
        if f".{_QKV}." not in name:
            out[name] = w
            continue
        if w.shape[0] != sum(rows):
            raise ModelFormatError(
                f"attn_qkv of layer {name.split('.')[2]} has {w.shape[0]} rows, but the metadata "
                f"implies {sum(rows)} (queries {rows[0]}, keys {rows[1]}, values {rows[2]})"
            )
        start = 0
        for part, count in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
            piece = w.tensor[start : start + count]
            out[name.replace("qkv_proj", part)] = weight_type(
                piece, w.ggml_type, (count, *w.shape[1:])
            )
            start += count
    return out
