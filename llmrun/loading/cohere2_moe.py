"""Cohere 2 MoE at the loader edge: a "cohere2moe" GGUF read as llama.cpp reads it
(src/models/cohere2moe.cpp, written by conversion/command_r.py Cohere2MoeModel) into
llmrun's cohere2_moe config, and the experts of a checkpoint that transformers saved
stacked, split into llmrun's per-expert modules.

The converter writes TextModel's keys (key_length: head_dim; feed_forward_length: the
dense prefix's width, prefix_dense_intermediate_size, else intermediate_size;
expert_gating_func from expert_selection_fn, which llama.cpp takes to be the sigmoid
where absent), the experts' width as expert_feed_forward_length, the dense prefix as
leading_dense_block_count, each layer's kind as a sliding_window_pattern array and
norm_topk_prob as expert_weights_norm. Its q/k rows are
as they are (adjacent-pair RoPE, as the model rotates), its experts stacked per
projection, its multi-token-prediction layers after the trunk's (skipped: llama.cpp's
inference does not run them). llama.cpp rotates every leading dense layer and averages
the shared experts with the routed ones, as transformers does with its defaults.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = "cohere2moe"
MODEL_TYPE = "cohere2_moe"
SWA_PATTERN = 4  # load_swa_pattern(ml, 4, true): layer i local unless i % 4 == 0
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_OUTPUT = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
# A MoE layer's GGUF tensors (after blk.N.) -> the HF module under model.layers.N.mlp.
_MOE_NAMES = {
    "ffn_gate_inp": "gate",
    "ffn_gate_exps": "experts.{expert}.gate_proj",
    "ffn_up_exps": "experts.{expert}.up_proj",
    "ffn_down_exps": "experts.{expert}.down_proj",
    "ffn_gate_shexp": "shared_experts.gate_proj",
    "ffn_up_shexp": "shared_experts.up_proj",
    "ffn_down_shexp": "shared_experts.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a cohere2moe MoE tensor (a stack of experts: with an {expert}
    field), or None for the tensors every family names alike."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _MOE_NAMES:
        return None
    return f"model.layers.{parts[1]}.mlp.{_MOE_NAMES[parts[2]]}.{parts[3]}"


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A checkpoint's weights under llmrun's names: the Hub's per-expert tensors as they
    are, transformers 5's stacks (experts.gate_up_proj [E, 2I, D], down_proj [E, D, I])
    split into them."""
    hidden, width = config["hidden_size"], config["intermediate_size"]
    return experts.split_stacked(weights, _STACKED, hidden, width, weight_type)


def config_from_gguf(gg: GGUFFile, rope_from_gguf) -> dict[str, Any]:
    """An HF-style cohere2_moe config from a cohere2moe GGUF's metadata, llama.cpp's
    defaults where a key is absent. `rope_from_gguf` is gguf_config's RoPE reader."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    layers, nextn = glm4_moe.trunk_layers(gg, arch)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not (isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0):
        raise ModelFormatError(
            f"{path}: an embedding length of {hidden!r} and a head count of {n_heads!r} "
            "are not positive whole numbers"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: keys and values of different lengths are not supported")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope or rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{path}: a {arch} model with partial or scaled RoPE is not supported; "
            "Cohere 2 MoE rotates whole heads unscaled"
        )
    base_swa = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if base_swa is not None and base_swa != rope["rope_theta"]:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Rope.FREQ_BASE_SWA)} differs from {meta.name(Keys.Rope.FREQ_BASE)}; "
            "llama.cpp's cohere2moe graph rotates every layer by the one base"
        )
    rms_eps = meta.get(Keys.Attention.LAYERNORM_RMS_EPS)
    ln_eps = meta.get(Keys.Attention.LAYERNORM_EPS)
    if rms_eps is None and ln_eps is None:
        raise ModelFormatError(
            f"{path}: neither {meta.name(Keys.Attention.LAYERNORM_RMS_EPS)} nor "
            f"{meta.name(Keys.Attention.LAYERNORM_EPS)} is set ({arch} needs one)"
        )
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not (isinstance(count, int) and isinstance(used, int) and 0 < used <= count):
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used!r} and "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} {count!r}: {arch} needs 1 to all of its experts"
        )
    dense = meta.require(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)
    if not isinstance(dense, int) or not 0 <= dense <= layers:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)} is {dense!r}, not 0 to {layers}"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if not isinstance(width, int):
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} per layer is not supported"
        )
    shared = meta.get(Keys.LLM.EXPERT_SHARED_COUNT, 0)
    shared_width = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) or width * shared
    if shared and shared_width != width * shared:
        raise UnsupportedError(
            f"{path}: shared experts {shared_width} wide, not {shared} times the experts' "
            f"{width}, are not supported"
        )
    config = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": width,
        "prefix_dense_intermediate_size": (
            meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
            if dense > 0
            else meta.get(Keys.LLM.FEED_FORWARD_LENGTH)
        ),
        "num_hidden_layers": layers,
        glm4_moe.NEXTN: nextn,
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        "layer_norm_eps": ln_eps if ln_eps is not None else 1e-5,
        "rms_norm_eps": rms_eps,  # None: Cohere's LayerNorm (llama.cpp's LLM_NORM)
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "logit_scale": meta.require(Keys.LLM.LOGIT_SCALE) or 1.0,  # 0: unscaled
        "tie_word_embeddings": _OUTPUT not in gg.tensors,
        "attention_bias": False,  # the converter refuses non-zero biases, drops the rest
        "rope_parameters": rope,
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "layer_types": _layer_types(gg, meta, layers),
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
        # llama.cpp rotates every leading dense layer: transformers' force_rope with 1.
        "prefix_dense_sliding_window_pattern": 1,
        "num_experts": count,
        "num_experts_per_tok": used,
        "num_shared_experts": shared,
        "shared_expert_combination_strategy": "average",  # llama.cpp's (x + shexp) * 0.5
        **_routing(gg, meta),
    }
    return config


def _layer_types(gg: GGUFFile, meta: ArchMetadata, layers: int) -> list[str]:
    """load_swa_pattern(ml, 4, true): a per-layer flag array (the converter's, one per
    trunk layer), else a period n (default 4) with layer i global where i % n == 0."""
    value = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, SWA_PATTERN)
    if isinstance(value, list) and len(value) >= layers:
        local = [bool(v) for v in value[:layers]]
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        local = [value == 0 or i % value != 0 for i in range(layers)]
    else:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=gg.architecture)} "
            f"is {value!r}, not a period or a flag for each of the {layers} layers"
        )
    return ["sliding_attention" if s else "full_attention" for s in local]


def _routing(gg: GGUFFile, meta: ArchMetadata) -> dict[str, Any]:
    """The router's config fields as llama.cpp's build_moe_ffn weighs the experts: the
    sigmoid (also where no gating function is given), renormalized with
    expert_weights_norm (default false); the softmax only renormalized, as transformers'
    softmax of the top k logits is (unnormalized, llama.cpp's would not be the model's)."""
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, 0)
    norm = bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False))
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_SCALE)} {scale} scales the experts' "
            "weights, which Cohere 2 MoE does not"
        )
    if gating in (0, ExpertGatingFuncType.SIGMOID):
        return {"expert_selection_fn": "sigmoid", "norm_topk_prob": norm}
    if gating == ExpertGatingFuncType.SOFTMAX and norm:
        return {"expert_selection_fn": "softmax", "norm_topk_prob": True}
    raise UnsupportedError(
        f"{gg.path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} {gating} with "
        f"{meta.name(Keys.LLM.EXPERT_WEIGHTS_NORM)} {norm} is not a Cohere 2 MoE router "
        "(the sigmoid, or the softmax renormalized over the top k)"
    )
