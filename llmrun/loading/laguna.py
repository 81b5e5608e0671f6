"""Laguna checkpoints at the loader edge: the Hub's folders, and GGUFs (arch "laguna") as
llama.cpp's converter writes them (conversion/laguna.py LagunaModel), read as
src/models/laguna.cpp reads them.

The Hub's keys hold the selection bias as mlp.experts.e_score_correction_bias and the
shared expert as mlp.shared_expert; transformers renames them (conversion_mapping.py)
to the names llmrun's model carries, and so does hf_weights, which also splits the
stacked experts transformers 5 saves.

The converter keeps q/k rows as they are (llama.cpp rotates laguna with NEOX RoPE), and
writes each layer's head count as an array, the global layers' RoPE (base, rotated
width, YaRN) as the plain rope keys and the sliding layers' base and width as the
*_swa ones, the window where there is one, leading_dense_block_count from the leading
"dense" entries of mlp_layer_types, the shared expert's width, the weights norm (always
true) and scale, sigmoid gating, the gate g_proj as attn_gate (its rows: one per head,
or one per feature), the selection bias as exp_probs_b.bias and the experts stacked. It
writes no layer pattern: llama.cpp makes layer i global where i % 4 == 0 (load_swa_pattern
with dense_first) unless the file has attention.sliding_window_pattern, and no router
soft-capping, which llama.cpp does not compute either.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

# gguf-py's MODEL_ARCH.LAGUNA (newer than the gguf package llmrun depends on).
ARCH = MODEL_TYPE = "laguna"
SWA_PATTERN = 4  # load_swa_pattern(ml, 4, dense_first=true): layer i global where i % 4 == 0


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> the module in llmrun's layer where it differs from the common
# names (gguf_config); a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    _short(MODEL_TENSOR.ATTN_GATE): "self_attn.g_proj",
    _short(MODEL_TENSOR.FFN_GATE_INP): "mlp.gate",
    _short(MODEL_TENSOR.FFN_GATE_SHEXP): "mlp.shared_experts.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_SHEXP): "mlp.shared_experts.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_SHEXP): "mlp.shared_experts.down_proj",
    _short(MODEL_TENSOR.FFN_GATE_EXP): "mlp.experts.{expert}.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "mlp.experts.{expert}.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "mlp.experts.{expert}.down_proj",
}
_SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)
# The Hub's names -> transformers' (and llmrun's), inside a layer.
_HUB_NAMES = {
    ".mlp.experts.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
    ".mlp.shared_expert.": ".mlp.shared_experts.",
}
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a laguna layer tensor, or None where it is not one of Laguna's
    own (the common names apply then)."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.mlp.gate.e_score_correction_bias"
    if name in _LAYER_NAMES and suffix == "weight":
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A Hub folder's weights under llmrun's keys: the selection bias and the shared
    expert renamed as transformers renames them, stacked experts (what transformers 5
    saves) split per expert. `weight_type` is the loader's Weight."""
    out = {}
    for name, w in weights.items():
        for old, new in _HUB_NAMES.items():
            name = name.replace(old, new)
        out[name] = w
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 512)
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config of a laguna GGUF, as llama_model_laguna::load_arch_hparams
    reads it (rope_from_gguf is gguf_config's reader of the global layers' RoPE keys)."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = _per_layer(gg, meta.require(Keys.Attention.HEAD_COUNT), layers)
    kv_heads = set(_per_layer(gg, meta.get(Keys.Attention.HEAD_COUNT_KV, heads), layers))
    if len(kv_heads) != 1:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.HEAD_COUNT_KV)} differs between layers, which "
            "llmrun's Laguna does not support"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads[0]
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: Laguna's keys and values of different widths")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads[0],
        "num_attention_heads_per_layer": heads,
        "num_key_value_heads": kv_heads.pop(),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors,
        "gating": _gating(gg, heads, head_dim),
    }
    config.update(
        _attention_layers(gg, meta, head_dim, rope_from_gguf(gg, meta, head_dim, context))
    )
    config.update(_experts(gg, meta, layers))
    return config


def _per_layer(gg: GGUFFile, value: Any, layers: int) -> list[int]:
    """A key llama.cpp reads with get_key_or_arr: one value, or one per layer."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ModelFormatError(f"{gg.path}: a per-layer key lists {len(values)} of {layers} layers")
    return list(values)


def _gating(gg: GGUFFile, heads: list[int], head_dim: int) -> str:
    """The gate's kind, from each layer's attn_gate rows as llama.cpp tells it: one per
    head ("per-head") or per feature ("per-element"); other widths, or layers of both
    kinds, are refused."""
    kinds = set()
    for layer, n in enumerate(heads):
        name = f"blk.{layer}.{_short(MODEL_TENSOR.ATTN_GATE)}.weight"
        info = gg.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{gg.path}: tensor {name!r} is missing")
        rows = info.shape[0]
        if rows not in (n, n * head_dim):
            raise ModelFormatError(
                f"{gg.path}: tensor {name!r} has {rows} rows, but a gate has {n} (one per "
                f"head) or {n * head_dim} (one per feature)"
            )
        kinds.add("per-head" if rows == n else "per-element")
    if len(kinds) != 1:
        raise UnsupportedError(
            f"{gg.path}: Laguna layers gated per head and per feature in one model are not "
            "supported"
        )
    return kinds.pop()


def _attention_layers(
    gg: GGUFFile, meta: ArchMetadata, head_dim: int, rope: dict[str, Any]
) -> dict[str, Any]:
    """The window, layer types and each type's RoPE: the sliding layers' (where a window
    makes some) turn by rope.freq_base_swa (default the global base) over
    rope.dimension_count_swa features (default the global layers'), never scaled."""
    layers = meta.get(Keys.LLM.BLOCK_COUNT)
    if rope["rope_type"] not in ("default", "yarn"):
        raise UnsupportedError(
            f"{gg.path}: Laguna with {rope['rope_type']} RoPE scaling is not supported"
        )
    if rope["rope_type"] == "yarn":
        ext = meta.get(Keys.Rope.SCALING_YARN_EXT_FACTOR)
        if ext is not None and ext != 1.0:
            raise UnsupportedError(
                f"{gg.path}: a YaRN extrapolation factor of {ext} is not supported (1.0 is)"
            )
        # llama.cpp scales YaRN's magnitude by 0.1 ln(factor) + 1 whatever this key says
        # (llama_context's constructor); transformers by the config's attention_factor.
        attn_factor = meta.get(Keys.Rope.SCALING_YARN_ATTN_FACTOR)
        factor = rope.get("factor") or 1.0
        usual = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
        if attn_factor is not None and abs(attn_factor - usual) > 1e-6:
            raise UnsupportedError(
                f"{gg.path}: {meta.name(Keys.Rope.SCALING_YARN_ATTN_FACTOR)} is {attn_factor}, "
                f"which llama.cpp does not apply ({usual:.6g} instead); llmrun does not "
                "guess which the model needs"
            )
    if meta.get(Keys.Rope.SCALING_ATTN_FACTOR, 1.0) != 1.0:
        raise UnsupportedError(
            f"{gg.path}: {meta.name(Keys.Rope.SCALING_ATTN_FACTOR)} other than 1 is not supported"
        )
    window = meta.get(Keys.Attention.SLIDING_WINDOW, 0)
    if not window:
        # No window: llama.cpp runs every layer as a global one.
        return {
            "sliding_window": None,
            "layer_types": ["full_attention"] * layers,
            "rope_parameters": {"full_attention": rope},
        }
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN, SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelFormatError(
                f"{gg.path}: {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)} lists "
                f"{len(pattern)} layers, but the model has {layers}"
            )
        local = [bool(v) for v in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        local = [pattern == 0 or i % pattern != 0 for i in range(layers)]
    else:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)} is {pattern!r}, not "
            "a layer count or a list of flags"
        )
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT_SWA) or round(
        head_dim * rope.get("partial_rotary_factor", 1.0)
    )
    if rotated % 2 or not 0 < rotated <= head_dim:
        raise ModelFormatError(
            f"{gg.path}: {meta.name(Keys.Rope.DIMENSION_COUNT_SWA)} is {rotated}, but RoPE "
            f"rotates pairs of the {head_dim} features of a head"
        )
    sliding = {
        "rope_type": "default",
        "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, rope["rope_theta"]),
        "partial_rotary_factor": rotated / head_dim,
    }
    return {
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
        "rope_parameters": {"full_attention": rope, "sliding_attention": sliding},
    }


def _experts(gg: GGUFFile, meta: ArchMetadata, layers: int) -> dict[str, Any]:
    """The experts and their routing: sigmoid gating where no key says otherwise, no
    scale where expert_weights_scale is 0 or absent, one shared expert as wide as
    expert_shared_feed_forward_length (or expert_shared_count experts), dense layers
    the leading_dense_block_count first. Refuses softmax gating and top-k weights that
    are not renormalized (absent expert_weights_norm included: llama.cpp's default)."""
    path = gg.path
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, 0)
    if gating not in (0, ExpertGatingFuncType.SIGMOID):  # 0: none given, sigmoid
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; Laguna's experts are gated by "
            "sigmoid, the only gating llmrun runs them with"
        )
    if not meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False):
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_WEIGHTS_NORM)} is false or absent; Laguna "
            "renormalizes its top-k expert weights, and llmrun runs it that way only"
        )
    widths = set(_per_layer(gg, meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), layers))
    if len(widths) != 1:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between layers, "
            "which llmrun does not support"
        )
    width = widths.pop()
    shared = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) or width * meta.get(
        Keys.LLM.EXPERT_SHARED_COUNT, 1
    )
    dense = meta.require(Keys.LLM.LEADING_DENSE_BLOCK_COUNT)
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared,
        "moe_routed_scaling_factor": meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        "mlp_layer_types": ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0),
    }
