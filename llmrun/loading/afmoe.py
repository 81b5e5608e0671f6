"""AFMoE GGUFs (arch "afmoe": Arcee Trinity) as llama.cpp's converter writes them
(conversion/afmoe.py AfmoeModel: LlamaModel's keys with q/k rows as they are, since
llama.cpp rotates AFMoE with NEOX RoPE; expert_shared_count, expert_feed_forward_length,
leading_dense_block_count, expert_weights_norm and expert_weights_scale from the
config's num_shared_experts, moe_intermediate_size, num_dense_layers, route_norm and
route_scale where it has them; expert_gating_func from its score_func; the window; the
experts stacked; expert_bias as exp_probs_b.bias), read as src/models/afmoe.cpp reads
them:

- the embeddings always scaled by sqrt(embedding_length) (muP; no key says otherwise);
- without leading_dense_block_count no dense layers, without expert_weights_norm the
  top-k weights not renormalized, without expert_weights_scale (or 0) not scaled, and
  without expert_gating_func sigmoid scores;
- with a window, the local layers from load_swa_pattern(ml, 4), their RoPE base
  rope.freq_base_swa where given; RoPE on every layer but each fourth, window or not,
  which must be the local layers (transformers rotates those alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "afmoe"
NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step, which it reads no key for
SWA_PATTERN = 4  # load_swa_pattern(ml, 4): every fourth layer global
GATING = {
    int(ExpertGatingFuncType.SOFTMAX): "softmax",
    int(ExpertGatingFuncType.SIGMOID): "sigmoid",
}


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> the HF module in the layer, where AFMoE differs from the common
# names; a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    _short(MODEL_TENSOR.ATTN_POST_NORM): "post_attention_layernorm",
    _short(MODEL_TENSOR.FFN_PRE_NORM): "pre_mlp_layernorm",
    _short(MODEL_TENSOR.FFN_POST_NORM): "post_mlp_layernorm",
    _short(MODEL_TENSOR.ATTN_GATE): "self_attn.gate_proj",
    _short(MODEL_TENSOR.FFN_GATE_INP): "mlp.router.gate",
    _short(MODEL_TENSOR.FFN_GATE_SHEXP): "mlp.shared_experts.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_SHEXP): "mlp.shared_experts.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_SHEXP): "mlp.shared_experts.down_proj",
    _short(MODEL_TENSOR.FFN_GATE_EXP): "mlp.experts.{expert}.gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "mlp.experts.{expert}.up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "mlp.experts.{expert}.down_proj",
}
_SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for an AFMoE layer tensor, or None where it is not one of AFMoE's
    own (the common names apply then)."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.mlp.expert_bias"
    if name in _LAYER_NAMES and suffix == "weight":
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    layer_types: Callable[..., list[str]],
) -> None:
    """AFMoE's fields of the HF-style config that config_from_gguf built, as
    llama_model_afmoe::load_arch_hparams reads them (`layer_types` is gguf_config's
    reader of llama.cpp's window pattern). Refuses grouped routing, per-layer expert
    widths that differ, a gating function other than softmax or sigmoid, and local
    layers other than those llama.cpp rotates."""
    path, layers = gg.path, config["num_hidden_layers"]
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, int(ExpertGatingFuncType.SIGMOID))
    if gating == 0:  # LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: llama.cpp takes sigmoid
        gating = int(ExpertGatingFuncType.SIGMOID)
    if gating not in GATING:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; llmrun runs AFMoE's experts with "
            "softmax or sigmoid gating"
        )
    if meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0) > 1:
        raise UnsupportedError(
            f"{path}: AFMoE with grouped expert routing ({meta.name(Keys.LLM.EXPERT_GROUP_COUNT)}) "
            "is not supported"
        )
    config.update(
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        num_shared_experts=meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        num_dense_layers=meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        score_func=GATING[gating],
        route_norm=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        route_scale=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        mup_enabled=True,
        hidden_act="silu",
    )
    rotated = [
        "sliding_attention" if (i + 1) % NO_ROPE_STEP else "full_attention" for i in range(layers)
    ]
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    if not window:
        # No window: every layer attends to all earlier positions, and llama.cpp still
        # rotates all but each fourth; as "sliding" layers without a window they do.
        config.update(sliding_window=None, layer_types=rotated)
        return
    local = layer_types(gg, meta, layers, SWA_PATTERN)
    if local != rotated:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)} makes other layers "
            "local than llama.cpp rotates (every layer but each fourth); AFMoE rotates its "
            "local layers alone, and llmrun does not guess which the model was trained as"
        )
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None:
        config["rope_parameters"]["rope_theta"] = local_base  # the rotating layers' base
    config.update(sliding_window=window, layer_types=local)
