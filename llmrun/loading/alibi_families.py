"""BLOOM and MPT checkpoints and GGUFs, the ALiBi families.

Hugging Face folders name the modules transformer.word_embeddings / transformer.wte,
transformer.h.N / transformer.blocks.N, transformer.ln_f / transformer.norm_f (BLOOM's
own files without the "transformer." prefix); hf_weights renames those to llmrun's
(model.embed_tokens, model.layers.N, model.norm) and keeps the rest of each name.

llama.cpp's converter (conversion/bloom.py BloomModel, conversion/mpt.py MPTModel)
writes arch "bloom" and "mpt": context, embedding and feed-forward (4 * embedding)
lengths, block and head counts, attention.layer_norm_epsilon, and for MPT
attention.max_alibi_bias and attention.clamp_kqv. BLOOM's fused attn_qkv rows are
regrouped from each head's (query, key, value) to all queries, all keys, all values,
which gguf_weights undoes; MPT's Wqkv already has that order. src/models/bloom.cpp and
mpt.cpp read them: ALiBi with a maximum bias of 8 for BLOOM (not a key) and the file's
for MPT (none: no ALiBi, which transformers' MPT does not have).
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import starcoder2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

BLOOM = "bloom"
MPT = "mpt"
ARCHS = MODEL_TYPES = (BLOOM, MPT)

_RENAMES = {
    BLOOM: (
        (re.compile(r"^(transformer\.)?word_embeddings\."), "model.embed_tokens."),
        (re.compile(r"^(transformer\.)?word_embeddings_layernorm\."), "model.word_embeddings_layernorm."),
        (re.compile(r"^(transformer\.)?h\."), "model.layers."),
        (re.compile(r"^(transformer\.)?ln_f\."), "model.norm."),
    ),
    MPT: (
        (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
        (re.compile(r"^transformer\.blocks\."), "model.layers."),
        (re.compile(r"^transformer\.norm_f\."), "model.norm."),
    ),
}  # fmt: skip

_NAMES = {
    BLOOM: starcoder2.name_table(
        {
            MODEL_TENSOR.ATTN_NORM: "input_layernorm",
            MODEL_TENSOR.ATTN_QKV: "self_attention.query_key_value",
            MODEL_TENSOR.ATTN_OUT: "self_attention.dense",
            MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
            MODEL_TENSOR.FFN_UP: "mlp.dense_h_to_4h",
            MODEL_TENSOR.FFN_DOWN: "mlp.dense_4h_to_h",
        },
        {
            MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
            MODEL_TENSOR.TOKEN_EMBD_NORM: "model.word_embeddings_layernorm",
            MODEL_TENSOR.OUTPUT_NORM: "model.norm",
            MODEL_TENSOR.OUTPUT: "lm_head",
        },
    ),
    MPT: starcoder2.name_table(
        {
            MODEL_TENSOR.ATTN_NORM: "norm_1",
            MODEL_TENSOR.ATTN_QKV: "attn.Wqkv",
            MODEL_TENSOR.ATTN_OUT: "attn.out_proj",
            MODEL_TENSOR.FFN_NORM: "norm_2",
            MODEL_TENSOR.FFN_UP: "ffn.up_proj",
            MODEL_TENSOR.FFN_DOWN: "ffn.down_proj",
        },
        {
            MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
            MODEL_TENSOR.OUTPUT_NORM: "model.norm",
            MODEL_TENSOR.OUTPUT: "lm_head",
        },
    ),
}
# Tensors src/models/mpt.cpp may read that transformers' MPT has no place for.
_MPT_REFUSED = (MODEL_TENSOR.POS_EMBD, MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)


def hf_weights(weights: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A BLOOM or MPT folder's weights under llmrun's names (see the module's note)."""
    renamed = {}
    for name, weight in weights.items():
        for pattern, replacement in _RENAMES[model_type]:
            name = pattern.sub(replacement, name, count=1)
        renamed[name] = weight
    return renamed


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """The model's key of a bloom or mpt GGUF tensor, None where it has none."""
    return _NAMES[model_type](gguf_name)


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style bloom or mpt config.json dict from a GGUF's metadata, read as
    llama.cpp's load_hparams reads it; refuses what the model cannot run."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        raise ModelFormatError(
            f"{path}: an embedding length of {hidden!r} and a head count of {heads!r} "
            "are not positive whole numbers"
        )
    if meta.get(Keys.Attention.HEAD_COUNT_KV, heads) != heads:
        raise UnsupportedError(f"{path}: a {arch} model with fewer KV heads than heads")
    feed_forward = meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
    if feed_forward != 4 * hidden:
        raise UnsupportedError(
            f"{path}: a {arch} feed-forward of {feed_forward}, not 4 x the embedding length "
            f"({4 * hidden}), the only one {arch} has"
        )
    embed = gg.tensors.get(TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    common = {
        "model_type": arch,
        "vocab_size": (len(tokens) if tokens else None) or (embed.shape[0] if embed else None),
        "layer_norm_epsilon": meta.require(Keys.Attention.LAYERNORM_EPS),
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    }
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    common.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    if arch == BLOOM:
        return {**common, "max_position_embeddings": context}
    _refuse_mpt_tensors(gg)
    max_bias = meta.get(Keys.Attention.MAX_ALIBI_BIAS, 0.0)
    if not max_bias > 0:
        raise UnsupportedError(
            f"{path}: an mpt model without ALiBi ({Keys.Attention.MAX_ALIBI_BIAS.format(arch=arch)} "
            f"{max_bias}) is not supported"
        )
    clamp = meta.get(Keys.Attention.CLAMP_KQV, 0.0)
    return {
        **common,
        "expansion_ratio": 4,
        "max_seq_len": context,
        "no_bias": True,
        "attn_config": {
            "alibi": True,
            "alibi_bias_max": max_bias,
            "clip_qkv": clamp if clamp > 0 else None,  # llama.cpp clamps where it is > 0
        },
    }


def _refuse_mpt_tensors(gg: GGUFFile) -> None:
    refused = [TENSOR_NAMES[t].split(".")[-1] for t in _MPT_REFUSED]
    for name in gg.tensors:
        kind = name.split(".")[-2] if name.startswith("blk.") else name.rpartition(".")[0]
        if kind in refused or name.endswith(".bias") or name.endswith(".scales"):
            raise UnsupportedError(
                f"{gg.path}: tensor {name!r}: transformers' MPT, which llmrun follows, has no "
                "learned positions, q/k norms, biases or activation scales"
            )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """BLOOM's weights as the model takes them: each fused query_key_value (weight and
    bias) back in transformers' rows, each head's query, key and value together
    (whole rows of blocks where quantized). MPT's are as they are."""
    if config["model_type"] != BLOOM:
        return weights
    import torch  # here: list and show stay torch-free

    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    # File row of each model row: [3, H, D] -> [H, 3, D]
    order = torch.arange(3 * hidden).view(3, heads, hidden // heads).transpose(0, 1).flatten()
    out = {}
    for name, w in weights.items():
        if ".query_key_value." in name:
            if w.shape[0] != 3 * hidden:
                raise ModelFormatError(
                    f"attn_qkv of layer {name.split('.')[2]} has {w.shape[0]} rows, but the "
                    f"metadata implies {3 * hidden}"
                )
            w = weight_type(w.tensor[order], w.ggml_type, w.shape)
        out[name] = w
    return out
