"""Mellum checkpoints at the loader edge: the Hub's folders, and GGUFs (arch "mellum") as
llama.cpp's converter writes them (conversion/mellum.py MellumModel), read as
src/models/mellum.cpp reads them.

The converter keeps q/k rows as they are (llama.cpp turns mellum's RoPE NEOX-style, as
transformers does), stacks the experts, and writes TextModel's keys: the global layers'
RoPE base as rope.freq_base and the sliding layers' as rope.freq_base_swa (llama.cpp:
the global base where it is absent), the window and one flag per layer
(attention.sliding_window_pattern; without it llama.cpp's load_swa_pattern(ml, 4) makes
every fourth layer global), expert_feed_forward_length. llama.cpp's graph rotates whole
heads, gives every layer experts (there is no dense feed-forward in its mellum), gates
them by softmax and always renormalizes the top-k weights, scaling them by nothing:
whatever keys a file has for these, which it does not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

# gguf-py's MODEL_ARCH.MELLUM (newer than the gguf package llmrun depends on).
ARCH = MODEL_TYPE = "mellum"
SWA_PATTERN = 4  # load_swa_pattern(ml, 4): layer i global where i % 4 == 3
ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train where a file has none
_ROUTER = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP].split(".")[-1]  # blk.N.ffn_gate_inp
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")
_MTP_PREFIX = "mtp."  # the Hub's multi-token-prediction layer, which transformers ignores


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Hub folder's weights as llmrun's model takes them: without the
    multi-token-prediction layer, stacked experts (what transformers 5 saves) split per
    expert. `weight_type` is the loader's Weight."""
    kept = {name: w for name, w in weights.items() if not name.startswith(_MTP_PREFIX)}
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 896)
    return experts.split_stacked(kept, _STACKED, hidden, width, weight_type)


def config_from_gguf(
    gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]], layer_types: Callable[..., Any]
) -> dict[str, Any]:
    """The HF-style config of a mellum GGUF, as llama_model_mellum::load_arch_hparams and
    the general load_hparams read it. `rope_from_gguf` and `layer_types` are gguf_config's
    readers of the RoPE keys and of load_swa_pattern's layer flags."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.HEAD_COUNT)} is {heads!r}; llmrun's Mellum needs "
            "one head count for every layer"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise ModelFormatError(f"{path}: Mellum's keys and values of different widths")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        # llama.cpp requires output.weight (no tied embeddings in its mellum).
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors,
    }
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if rope["rope_type"] != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise UnsupportedError(
            f"{path}: Mellum with RoPE scaling or a partly rotated head is not supported "
            "(llmrun runs whole heads without scaling)"
        )
    window = meta.get(Keys.Attention.SLIDING_WINDOW, 0)
    kinds = layer_types(gg, meta, layers, SWA_PATTERN if window else None)
    sliding = {
        "rope_type": "default",
        "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, rope["rope_theta"]),
    }
    config.update(
        sliding_window=window or None,
        layer_types=kinds,
        rope_parameters={"full_attention": rope, "sliding_attention": sliding},
    )
    config.update(_experts(gg, meta, layers))
    return config


def _experts(gg: GGUFFile, meta: ArchMetadata, layers: int) -> dict[str, Any]:
    """Every layer's experts (a router each: llama.cpp's mellum has no dense layer), their
    count, how many a token takes, their width (one for all layers)."""
    path = gg.path
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    for layer in range(layers):
        if f"blk.{layer}.{_ROUTER}.weight" not in gg.tensors:
            raise UnsupportedError(
                f"{path}: layer {layer} has no experts (no {_ROUTER}); llama.cpp's mellum "
                "gives every layer experts, and llmrun reads these files as it does"
            )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    widths = set(width) if isinstance(width, list) else {width}
    if len(widths) != 1:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between layers, "
            "which llmrun does not support"
        )
    config = {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": widths.pop(),
        "norm_topk_prob": True,
        "mlp_layer_types": ["sparse"] * layers,
    }
    dense = meta.get(Keys.LLM.FEED_FORWARD_LENGTH)
    if isinstance(dense, int) and dense > 0:  # no layer uses it; as the file says
        config["intermediate_size"] = dense
    return config
