"""MiniMax-M2 GGUFs (arch "minimax-m2": M2, M2.1, M2.5) as llama.cpp's converter writes
them (conversion/minimax.py MiniMaxM2Model: TextModel's keys, with expert_gating_func
from the config's scoring_func, expert_feed_forward_length and rope.dimension_count from
intermediate_size and rotary_dim; q/k rows as they are, since llama.cpp rotates
MiniMax-M2 with NEOX RoPE; the experts stacked; e_score_correction_bias as
exp_probs_b.bias), read as src/models/minimax-m2.cpp reads them: the q/k norms over the
whole projection, experts feed_forward_length wide, their weights always renormalized
and never scaled. Also the Hugging Face folders' quantized (FP8) releases, refused.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "minimax-m2", "minimax_m2"
_BLOCK = "block_sparse_moe"


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor -> the HF module in the layer, where MiniMax-M2 differs from the
# common names; a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    _short(MODEL_TENSOR.FFN_GATE_INP): f"{_BLOCK}.gate",
    _short(MODEL_TENSOR.FFN_GATE_EXP): f"{_BLOCK}.experts.{{expert}}.w1",
    _short(MODEL_TENSOR.FFN_UP_EXP): f"{_BLOCK}.experts.{{expert}}.w3",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): f"{_BLOCK}.experts.{{expert}}.w2",
}
_SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a MiniMax-M2 layer tensor, or None where it is not one of
    MiniMax-M2's own (the common names apply then)."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.{_BLOCK}.e_score_correction_bias"
    if name in _LAYER_NAMES and suffix == "weight":
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """MiniMax-M2's fields of the HF-style config that config_from_gguf built, read as
    llama_model_minimax_m2::load_arch_hparams reads them: expert_count and
    expert_used_count; expert_feed_forward_length, which must be feed_forward_length (the
    width llama.cpp builds the experts with); expert_gating_func, which must be sigmoid
    (llama.cpp aborts without one); rope.dimension_count, the head size where absent.
    Grouped routing, which llama.cpp would apply where a file asks for it, and per-layer
    values that differ are refused."""
    path = gg.path
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = _one_value(gg, Keys.LLM.EXPERT_USED_COUNT, meta.get(Keys.LLM.EXPERT_USED_COUNT, 0))
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is None:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is missing; llama.cpp cannot run "
            "a MiniMax-M2 file without it either (MiniMax-M2's experts are gated by sigmoid)"
        )
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; llmrun runs MiniMax-M2's experts "
            "with sigmoid gating only"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    width = _one_value(gg, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, width)
    if width != config["intermediate_size"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} is {width}, but "
            f"{meta.name(Keys.LLM.FEED_FORWARD_LENGTH)} is {config['intermediate_size']} (llama.cpp "
            "builds MiniMax-M2's experts that wide; its converter writes both the same)"
        )
    if meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0) > 1:
        raise UnsupportedError(
            f"{path}: MiniMax-M2 with grouped expert routing "
            f"({meta.name(Keys.LLM.EXPERT_GROUP_COUNT)}) is not supported"
        )
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or config["head_dim"]  # llama.cpp's n_rot
    if rotated % 2 or rotated > config["head_dim"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rotated}, but RoPE rotates pairs "
            f"of the {config['head_dim']} features of a head"
        )
    config.update(num_local_experts=count, num_experts_per_tok=used)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Any) -> dict[str, Any]:
    """A Hugging Face folder's weights without layers past num_hidden_layers (as
    DeepSeek's, whose loader this is); the quantized releases (MiniMaxAI's own are FP8)
    are refused as DeepSeek-V3's are."""
    return deepseek2.hf_weights(weights, config, path)


def _one_value(gg: GGUFFile, template: str, value: Any) -> Any:
    """A key's value, where llama.cpp also takes one per layer (get_key_or_arr): a list
    of one value throughout is that value, one of several is refused."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise UnsupportedError(
            f"{gg.path}: {_full(template)} differs between layers, which llmrun does not support"
        )
    return value[0]


def _full(template: str) -> str:
    return template.format(arch=ARCH)
