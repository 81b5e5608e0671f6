"""GPT-BigCode (StarCoder 1, SantaCoder) checkpoints and GGUFs.

Hugging Face folders name the modules transformer.wte, transformer.wpe, transformer.h.N
and transformer.ln_f; hf_weights renames those to llmrun's (model.embed_tokens,
model.embed_positions, model.layers.N, model.norm) and keeps the rest of each name.

llama.cpp's converter (conversion/starcoder.py StarCoderModel) writes arch "starcoder":
context length n_positions, embedding length, feed-forward length 4 x the embedding
length, block and head counts, head_count_kv 1 (always: it converts multi-query models
only), attention.layer_norm_epsilon; the tensors as they are (the fused attn_qkv already
all queries, then the key head and the value head), no output tensor where the
embeddings are tied. src/models/starcoder.cpp reads them: learned positions
(position_embd), biased LayerNorms and projections, a tanh-GELU feed-forward, scores
scaled by 1/sqrt(head width).
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import starcoder2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "starcoder"
MODEL_TYPE = "gpt_bigcode"
# llama.cpp's LLM_FFN_GELU: GELU's tanh approximation.
GELU_TANH = "gelu_pytorch_tanh"

_RENAMES = (
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.wpe\."), "model.embed_positions."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
)

hf_name = starcoder2.name_table(
    {
        MODEL_TENSOR.ATTN_NORM: "ln_1",
        MODEL_TENSOR.ATTN_QKV: "attn.c_attn",
        MODEL_TENSOR.ATTN_OUT: "attn.c_proj",
        MODEL_TENSOR.FFN_NORM: "ln_2",
        MODEL_TENSOR.FFN_UP: "mlp.c_fc",
        MODEL_TENSOR.FFN_DOWN: "mlp.c_proj",
    },
    {
        MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
        MODEL_TENSOR.POS_EMBD: "model.embed_positions",
        MODEL_TENSOR.OUTPUT_NORM: "model.norm",
        MODEL_TENSOR.OUTPUT: "lm_head",
    },
)


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A GPT-BigCode folder's weights under llmrun's names (see the module's note)."""
    renamed = {}
    for name, weight in weights.items():
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name, count=1)
        renamed[name] = weight
    return renamed


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style gpt_bigcode config.json dict from a "starcoder" GGUF's metadata, read
    as llama.cpp's load_hparams reads it; refuses what llama.cpp's graph does not run."""
    path = gg.path
    meta = ArchMetadata.of(gg)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        raise ModelFormatError(
            f"{path}: an embedding length of {hidden!r} and a head count of {heads!r} "
            "are not positive whole numbers"
        )
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    if kv_heads not in (1, heads):
        raise UnsupportedError(
            f"{path}: a starcoder model with {kv_heads} KV heads; GPT-BigCode has 1 "
            f"(multi-query) or one per head ({heads})"
        )
    if kv_heads == heads and heads > 1:
        # transformers' per-head layout of c_attn, which the converter does not regroup
        # and llama.cpp's graph would read as all queries, all keys, all values.
        raise UnsupportedError(
            f"{path}: a starcoder model without multi-query attention is not supported "
            "(llama.cpp's converter writes its fused attn_qkv in a layout its graph misreads)"
        )
    if TENSOR_NAMES[MODEL_TENSOR.POS_EMBD] + ".weight" not in gg.tensors:
        raise ModelFormatError(f"{path}: tensor 'position_embd.weight' is missing")
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get(TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    return {
        "model_type": MODEL_TYPE,
        # GPTBigCodeConfig's attribute_map names, which `llmrun show` reads.
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "n_inner": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "layer_norm_epsilon": meta.require(Keys.Attention.LAYERNORM_EPS),
        "activation_function": GELU_TANH,
        "multi_query": True,
        "scale_attn_weights": True,
        "vocab_size": (len(tokens) if tokens else None) or (embed.shape[0] if embed else None),
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    }
