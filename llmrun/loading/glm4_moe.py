"""GLM-4.5 MoE GGUFs (arch "glm4moe": GLM-4.5, GLM-4.5-Air, GLM-4.6, Solar Open) as
llama.cpp's converter writes them (conversion/glm.py Glm4MoeModel) and llama.cpp reads
them (src/models/glm4-moe.cpp, llama-graph.cpp's build_moe_ffn), as the config and
tensor names of llmrun's glm4_moe model; and the multi-token-prediction layers that
llama.cpp's GLM files may hold, which llmrun skips as llama.cpp's inference does.

The converter keeps Hugging Face's q/k rows (GLM-4.5 rotates halves: llama.cpp's NEOX
RoPE, nothing to undo), writes the norm before the feed-forward as post_attention_norm,
e_score_correction_bias as exp_probs_b.bias, the experts stacked, the rotated width as
rope.dimension_count, and with its MTP layers (the default) block_count as
num_hidden_layers + nextn_predict_layers, those layers last.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, vl_text
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "glm4moe", "glm4_moe"
# HF model types whose checkpoints hold MTP layers past num_hidden_layers.
MTP_MODEL_TYPES = (MODEL_TYPE, "glm4_moe_lite")
# The config field that says how many MTP layers a GGUF's blocks end with.
NEXTN = "num_nextn_predict_layers"
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """A folder's weights with stacked experts split: transformers 5 saves GLM-4.5V's text
    so inside GLM-4.6V (glm46v), where its weight conversions, keyed by glm4v_moe, do not
    reach the language model; the Hub's files hold one module per expert."""
    width = config.get("moe_intermediate_size", 1408)
    return experts.split_stacked(weights, _STACKED, config["hidden_size"], width, weight_type)


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensor (after blk.N., without .weight) -> the HF module in the layer.
_LAYER_NAMES = {
    _short(t): name
    for t, name in [
        (MODEL_TENSOR.ATTN_NORM, "input_layernorm"),
        (MODEL_TENSOR.ATTN_POST_NORM, "post_attention_layernorm"),
        (MODEL_TENSOR.ATTN_Q, "self_attn.q_proj"),
        (MODEL_TENSOR.ATTN_K, "self_attn.k_proj"),
        (MODEL_TENSOR.ATTN_V, "self_attn.v_proj"),
        (MODEL_TENSOR.ATTN_OUT, "self_attn.o_proj"),
        (MODEL_TENSOR.ATTN_Q_NORM, "self_attn.q_norm"),
        (MODEL_TENSOR.ATTN_K_NORM, "self_attn.k_norm"),
        (MODEL_TENSOR.FFN_GATE, "mlp.gate_proj"),
        (MODEL_TENSOR.FFN_UP, "mlp.up_proj"),
        (MODEL_TENSOR.FFN_DOWN, "mlp.down_proj"),
        (MODEL_TENSOR.FFN_GATE_INP, "mlp.gate"),
        (MODEL_TENSOR.FFN_GATE_SHEXP, "mlp.shared_experts.gate_proj"),
        (MODEL_TENSOR.FFN_UP_SHEXP, "mlp.shared_experts.up_proj"),
        (MODEL_TENSOR.FFN_DOWN_SHEXP, "mlp.shared_experts.down_proj"),
    ]
}
_EXPERT_STACKS = {
    _short(MODEL_TENSOR.FFN_GATE_EXP): "gate_proj",
    _short(MODEL_TENSOR.FFN_UP_EXP): "up_proj",
    _short(MODEL_TENSOR.FFN_DOWN_EXP): "down_proj",
}
_SELECTION_BIAS = _short(MODEL_TENSOR.FFN_EXP_PROBS_B)


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a layer tensor of a glm4moe GGUF (a stack of experts:
    a template with an `{expert}` field), or None if the model has no such tensor. The
    global tensors are the common ones (gguf_config)."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if suffix not in ("weight", "bias") or len(parts) != 3 or parts[0] != "blk":
        return None
    if not parts[1].isdigit():
        return None
    layer, name = f"model.layers.{parts[1]}", parts[2]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.mlp.gate.e_score_correction_bias"
    if name in _EXPERT_STACKS:
        return f"{layer}.mlp.experts.{{expert}}.{_EXPERT_STACKS[name]}.{suffix}"
    if name in _LAYER_NAMES:
        return f"{layer}.{_LAYER_NAMES[name]}.{suffix}"
    return None


def mtp_tensor(gguf_name: str, config: dict[str, Any]) -> bool:
    """Whether a GGUF tensor belongs to a multi-token-prediction layer (blk.N with N past
    the config's num_hidden_layers, in a file that says it has such layers), which
    llama.cpp's inference never runs."""
    if not config.get(NEXTN):
        return False
    parts = gguf_name.split(".")
    return (
        len(parts) > 2
        and parts[0] == "blk"
        and parts[1].isdigit()
        and int(parts[1]) >= config["num_hidden_layers"]
    )


def trunk_layers(gg: GGUFFile, arch: str) -> tuple[int, int]:
    """The layers llama.cpp runs (block_count less nextn_predict_layers) and the MTP
    layers after them; a file of MTP layers alone (no blk.0.attn_norm) is refused."""
    blocks = gg.metadata.get(Keys.LLM.BLOCK_COUNT.format(arch=arch))
    nextn = gg.metadata.get(Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch), 0)
    if not isinstance(blocks, int) or not isinstance(nextn, int) or not 0 <= nextn < blocks:
        raise ModelFormatError(
            f"{gg.path}: {arch}.block_count is {blocks!r} and {arch}.nextn_predict_layers "
            f"{nextn!r}: no layers are left to run"
        )
    if nextn and "blk.0.attn_norm.weight" not in gg.tensors:
        raise UnsupportedError(
            f"{gg.path}: a file of multi-token-prediction layers only (an MTP draft) is "
            "not a model llmrun runs; use the main model's file"
        )
    return blocks - nextn, nextn


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """GLM-4.5 MoE's fields of the HF-style config that config_from_gguf built, read as
    llama_model_glm4_moe::load_arch_hparams reads them: the trunk's layer count, the
    q/k norms where the tensors are, the experts and their routing (sigmoid gating
    where no key says otherwise, no renormalization and no scale where no key asks
    for them, the expert width feed_forward_length / expert_used_count where absent;
    feed_forward_length itself only where something needs it: Solar Open's files, all
    experts, lack it), and RoPE on all of a head where rope.dimension_count is absent."""
    path = gg.path
    layers, nextn = trunk_layers(gg, ARCH)
    config.update(num_hidden_layers=layers, use_qk_norm="blk.0.attn_q_norm.weight" in gg.tensors)
    config[NEXTN] = nextn
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {ARCH}.expert_used_count is {used}, but {ARCH}.expert_count is {count} "
            f"(each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SIGMOID)
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {ARCH}.expert_gating_func is {known.get(gating, f'{gating} (unknown)')}; "
            "llmrun runs GLM-4.5's experts with sigmoid gating only"
        )
    dense_width, dense = (
        config["intermediate_size"],
        meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
    )
    width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or (dense_width or 0) // used
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {ARCH}.expert_feed_forward_length differs between layers, which "
                "llmrun does not support"
            )
        width = width[0]
    if not width or (dense and not dense_width):
        raise ModelFormatError(
            f"{path}: {ARCH}.feed_forward_length is missing; the expert width (no "
            f"{ARCH}.expert_feed_forward_length) or the {dense} leading dense layers need it"
        )
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0)
    grouped = groups > 1  # llama.cpp ignores one group or none
    config.update(
        n_routed_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        n_shared_experts=meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        first_k_dense_replace=dense,
        # 0 (no key): llama.cpp leaves the weights unscaled.
        routed_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        n_group=groups if grouped else 1,
        topk_group=meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0) if grouped else 1,
    )
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or config["head_dim"]
    if rotated % 2 or rotated > config["head_dim"]:
        raise ModelFormatError(
            f"{path}: {ARCH}.rope.dimension_count is {rotated}, but RoPE rotates pairs of "
            f"the {config['head_dim']} features of a head"
        )
    config["rope_parameters"]["partial_rotary_factor"] = rotated / config["head_dim"]
    # GLM-4.5V's text: llama.cpp's M-RoPE turns halves as its NEOX RoPE does, by the
    # token's position in every section (vl_text refuses sections where it would not).
    sections = vl_text.text_mrope_sections(gg, ARCH, meta, rotated)
    if sections:
        config["rope_parameters"]["mrope_section"] = sections[:3]
