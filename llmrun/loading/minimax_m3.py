"""MiniMax-M3 GGUFs (arch "minimax-m3") as llama.cpp's converter writes them
(conversion/minimax.py MiniMaxM3Model, a MiniMaxM2Model: TextModel's keys,
expert_feed_forward_length, rope.dimension_count from rotary_dim, the experts stacked, q/k
rows as they are since llama.cpp turns it with NEOX RoPE; plus expert_shared_count,
expert_weights_scale from routed_scaling_factor, expert_weights_norm, the indexer's keys
from sparse_attention_config, leading_dense_block_count from moe_layer_freq, and every
*norm.weight stored as 1 + w), read as src/models/minimax-m3.cpp reads them: the leading
dense layers run dense attention and a feed_forward_length-wide feed-forward, the others
sparse attention (their indexer tensors) and experts with expert_shared_count shared
experts of expert_feed_forward_length. Also the Hugging Face folders' language model.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name

ARCH, MODEL_TYPE = "minimax-m3", "minimax_m3"
# The config.json model_types of its language model: the text-only checkpoints', and the
# multimodal ones' text_config (the loader takes it out of minimax_m3_vl).
HF_MODEL_TYPES = (MODEL_TYPE, "minimax_m3_vl_text")
VL_MODEL_TYPE = "minimax_m3_vl"
# The multi-token-prediction head's keys, wherever it sits (transformers' pattern).
_MTP = re.compile(r"(^|\.)mtp\.")
_BLOCK = "block_sparse_moe"


# GGUF layer tensor -> the module in the layer (the checkpoint's names, llmrun's model's),
# where MiniMax-M3 differs from the common names; a stack of experts names each expert's.
_LAYER_NAMES = {
    layer_name(MODEL_TENSOR.FFN_GATE_INP): f"{_BLOCK}.gate",
    layer_name(MODEL_TENSOR.FFN_GATE_EXP): f"{_BLOCK}.experts.{{expert}}.w1",
    layer_name(MODEL_TENSOR.FFN_UP_EXP): f"{_BLOCK}.experts.{{expert}}.w3",
    layer_name(MODEL_TENSOR.FFN_DOWN_EXP): f"{_BLOCK}.experts.{{expert}}.w2",
    layer_name(MODEL_TENSOR.FFN_GATE_SHEXP): f"{_BLOCK}.shared_experts.gate_proj",
    layer_name(MODEL_TENSOR.FFN_UP_SHEXP): f"{_BLOCK}.shared_experts.up_proj",
    layer_name(MODEL_TENSOR.FFN_DOWN_SHEXP): f"{_BLOCK}.shared_experts.down_proj",
    # MiniMax's indexer (gguf-py's INDEXER_{Q,K}_PROJ and INDEXER_Q_NORM, newer than
    # the gguf package llmrun requires, and INDEXER_K_NORM).
    "indexer.q_proj": "self_attn.index_q_proj",
    "indexer.k_proj": "self_attn.index_k_proj",
    "indexer.q_norm": "self_attn.index_q_norm",
    "indexer.k_norm": "self_attn.index_k_norm",
}
_SELECTION_BIAS = layer_name(MODEL_TENSOR.FFN_EXP_PROBS_B)
# The indexer's keys (MiniMax Sparse Attention; gguf-py's Keys.Attention.Indexer, whose
# block_size and local_blocks are newer than the gguf package llmrun requires) ->
# MiniMaxM3VLTextConfig's fields.
_INDEXER_KEYS = {
    "{arch}.attention.indexer.head_count": "index_n_heads",
    "{arch}.attention.indexer.key_length": "index_head_dim",
    "{arch}.attention.indexer.top_k": "index_topk_blocks",
    "{arch}.attention.indexer.block_size": "index_block_size",
    "{arch}.attention.indexer.local_blocks": "index_local_blocks",
}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a MiniMax-M3 layer tensor, or None where the common names apply."""
    parts = gguf_name.split(".")
    if len(parts) < 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name, suffix = f"model.layers.{parts[1]}", ".".join(parts[2:-1]), parts[-1]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.{_BLOCK}.e_score_correction_bias"
    if name in _LAYER_NAMES and suffix == "weight":
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """MiniMax-M3's fields of the HF-style config that config_from_gguf built, read as
    llama_model_minimax_m3::load_arch_hparams reads them (every key it requires
    required here; expert_weights_scale absent: no scaling; expert_weights_norm absent:
    no renormalization, which llmrun refuses, as transformers always renormalizes)."""
    path = gg.path
    layers = config["num_hidden_layers"]
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.require(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {gating}; llmrun runs "
            "MiniMax-M3's experts with sigmoid gating only"
        )
    if not meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False):
        raise UnsupportedError(
            f"{path}: MiniMax-M3 without {meta.name(Keys.LLM.EXPERT_WEIGHTS_NORM)} (experts' "
            "weights not renormalized) is not supported"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between layers"
            )
        width = width[0]
    shared = meta.require(Keys.LLM.EXPERT_SHARED_COUNT)
    dense = meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    if not 0 <= dense <= layers:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)} is {dense} of {layers} layers"
        )
    # llama.cpp runs the leading dense layers' attention dense, the others' sparse.
    config.update(
        dense_intermediate_size=config["intermediate_size"],
        intermediate_size=width,
        shared_intermediate_size=width * shared,
        num_local_experts=count,
        num_experts_per_tok=used,
        routed_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        layer_types=["full_attention"] * dense + ["minimax_m3_sparse"] * (layers - dense),
    )
    for template, field in _INDEXER_KEYS.items():
        config[field] = meta.require(template)


def cache_head_dim(text: dict[str, Any], head_dim: int) -> int:
    """The width llmrun caches each head at for a text config.json dict (or the one
    config_from_gguf builds): the head, and the indexer's key after it where any layer
    attends sparsely (llmrun.models.minimax_m3.ModelArgs.cache_head_dim)."""
    sparse_config = text.get("sparse_attention_config") or {}
    kinds = text.get("layer_types") or [
        "minimax_m3_sparse" if f else "full_attention"
        for f in sparse_config.get("sparse_attention_freq") or []
    ]
    if "minimax_m3_sparse" not in kinds[: text.get("num_hidden_layers")]:
        return head_dim
    return head_dim + int(
        text.get("index_head_dim") or sparse_config.get("sparse_index_dim") or 128
    )


def refuse_quantized(config: dict[str, Any], path: Any) -> None:
    """A multimodal folder's quantized (FP8) release refused by its top-level
    quantization_config, before the loader takes its text_config out."""
    deepseek2.hf_weights({}, config, path)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Any) -> dict[str, Any]:
    """A Hugging Face folder's text weights: without the multi-token-prediction head
    (mtp.*, which neither transformers nor llama.cpp runs) and layers past
    num_hidden_layers; quantized (FP8) releases refused as DeepSeek-V3's are."""
    weights = {name: w for name, w in weights.items() if not _MTP.search(name)}
    return deepseek2.hf_weights(weights, config, path)
