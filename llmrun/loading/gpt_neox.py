"""GPT-NeoX at the loader edge: "gptneox" GGUFs as llama.cpp's converter writes them
(conversion/gptneox.py GPTNeoXModel) and llama.cpp reads them (src/models/gptneox.cpp),
and the Hub's checkpoints under transformers 5's names (llmrun/models/gpt_neox.py).

The converter writes context, embedding and feed-forward lengths, the block and head
counts, rope.dimension_count = int(rotary_pct * head width), use_parallel_residual and
attention.layer_norm_epsilon, and no RoPE base (llama.cpp's 10000); it reorders the
fused query_key_value's rows (and bias) from transformers' per head [heads, q|k|v,
head_dim] to all queries, all keys, all values, which gguf_weights undoes. llama.cpp
turns halves (NEOX) of the first rope.dimension_count features (every feature where the
key is absent), and its feed-forward GELU is the tanh approximation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import starcoder2

if TYPE_CHECKING:
    from llmrun.loading.gguf_io import GGUFFile

ARCH, MODEL_TYPE = "gptneox", "gpt_neox"
GELU_TANH = "gelu_new"  # llama.cpp's LLM_FFN_GELU
hf_name = starcoder2.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "input_layernorm",
        MODEL_TENSOR.ATTN_QKV: "attention.query_key_value",
        MODEL_TENSOR.ATTN_OUT: "attention.dense",
        MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
        MODEL_TENSOR.FFN_UP: "mlp.dense_h_to_4h",
        MODEL_TENSOR.FFN_DOWN: "mlp.dense_4h_to_h",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "model.embed_in",
        MODEL_TENSOR.OUTPUT_NORM: "model.final_layer_norm",
        MODEL_TENSOR.OUTPUT: "lm_head",
    },
)
# The Hub's names -> transformers 5's (which llmrun's model has, with model. for gpt_neox.),
# and the buffers older checkpoints carry that are not weights.
_HUB_PREFIXES = {"gpt_neox.": "model.", "embed_out.": "lm_head."}
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style gpt_neox config from a gptneox GGUF's metadata, as llama_model_gptneox's
    load_arch_hparams and the common load_hparams read it (use_parallel_residual and the
    LayerNorms' epsilon required). `rope_from_gguf` is gguf_config's reader of the RoPE
    keys. Refuses KV heads other than the heads, which GPT-NeoX does not have."""
    config = starcoder2.shape_config(gg, rope_from_gguf)
    parallel = Keys.LLM.USE_PARALLEL_RESIDUAL.format(arch=ARCH)
    if parallel not in gg.metadata:
        raise ModelFormatError(f"{gg.path}: metadata {parallel!r} is missing (gptneox needs it)")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["num_key_value_heads"] != heads or config["head_dim"] * heads != hidden:
        raise UnsupportedError(
            f"{gg.path}: a gptneox model of {heads} heads with {config['num_key_value_heads']} "
            f"KV heads of {config['head_dim']} features in {hidden} is not supported "
            "(GPT-NeoX has as many KV heads as heads, of hidden size / heads features)"
        )
    # Without rope.dimension_count llama.cpp turns whole heads (not transformers' 0.25).
    config["rope_parameters"].setdefault("partial_rotary_factor", 1.0)
    qkv_bias = TENSOR_NAMES[MODEL_TENSOR.ATTN_QKV].format(bid=0) + ".bias"
    config.update(
        model_type=MODEL_TYPE,
        hidden_act=GELU_TANH,
        use_parallel_residual=bool(gg.metadata[parallel]),
        attention_bias=qkv_bias in gg.tensors,
        tie_word_embeddings=TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    )
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: each attn_qkv's rows (weight and bias; whole
    blocks where quantized) from the file's queries, keys, values back to transformers'
    per-head order."""
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    out = {}
    for name, w in weights.items():
        if ".attention.query_key_value." not in name:
            out[name] = w
            continue
        if w.shape[0] != 3 * heads * head_dim:
            raise ModelFormatError(
                f"attn_qkv of layer {name.split('.')[2]} has {w.shape[0]} rows, but the "
                f"metadata implies {3 * heads * head_dim} ({heads} heads of {head_dim}, 3 times)"
            )
        # [3 * H * D, ...] -> [3, H, D, ...] -> [H, 3, D, ...]
        rows = w.tensor.unflatten(0, (3, heads, head_dim)).transpose(0, 1).flatten(0, 2)
        out[name] = weight_type(rows.contiguous(), w.ggml_type, w.shape)
    return out


def hf_weights(weights: dict[str, Any]) -> dict:
    """A Hub checkpoint's tensors under llmrun's names (gpt_neox. as model., embed_out. as
    lm_head.), without the attention's mask buffers that older checkpoints hold."""
    out = {}
    for name, w in weights.items():
        if name.endswith(_BUFFERS):
            continue
        for old, new in _HUB_PREFIXES.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        out[name] = w
    return out
