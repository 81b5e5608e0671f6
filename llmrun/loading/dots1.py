"""dots.llm1 GGUFs (arch "dots1") as llama.cpp's converter writes them
(conversion/dots1.py Dots1Model, a Qwen2MoeModel: TextModel's keys, the q/k rows as
they are for its NEOX RoPE, the experts stacked, e_score_correction_bias as
exp_probs_b.bias, the shared experts as ffn_*_shexp, first_k_dense_replace as
leading_dense_block_count, n_shared_experts as expert_shared_count,
routed_scaling_factor as expert_weights_scale, norm_topk_prob as expert_weights_norm,
and the config's scoring_func as expert_gating_func), read as src/models/dots1.cpp
reads them, as the config and tensor names of llmrun's dots1 model.
"""

from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "dots1", "dots1"
# GGUF layer tensor -> the module in llmrun's layer where it differs from the common
# names (gguf_config); a stack of experts names each expert's with an {expert} field.
_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
_SELECTION_BIAS = "exp_probs_b"
_BIAS_KEY = "mlp.gate.e_score_correction_bias"


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a dots1 layer tensor where it is not one of the common names
    (gguf_config), or None."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, name, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
    if name == _SELECTION_BIAS and suffix == "bias":
        return f"{layer}.{_BIAS_KEY}"
    if name in _LAYER_NAMES and suffix == "weight":
        return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return None


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """dots.llm1's fields of the HF-style config that config_from_gguf built, as
    llama_model_dots1::load_arch_hparams and llama.cpp's load_hparams read them: the
    experts (expert_feed_forward_length and expert_shared_count required), the leading
    dense layers (0 where absent), groups only where expert_group_count is over 1, no
    renormalization and no scale where the keys are absent. Refuses a file without
    sigmoid gating (llama.cpp aborts on one without the key, and transformers' dots1
    is sigmoid-gated) and partial RoPE (llama.cpp asserts whole heads)."""
    path = gg.path
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        said = "missing" if gating is None else f"{known.get(gating, f'{gating} (unknown)')}"
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {said}; dots.llm1's experts "
            "are gated by sigmoid, the only gating llmrun runs them with"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    if "partial_rotary_factor" in config["rope_parameters"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is not the head size "
            f"{config['head_dim']}; dots.llm1 rotates whole heads"
        )
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0)
    grouped = groups > 1  # llama.cpp ignores one group or none
    config.update(
        n_routed_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        n_shared_experts=meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        first_k_dense_replace=meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        # 0 (no key): llama.cpp leaves the weights unscaled.
        routed_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        n_group=groups if grouped else 1,
        topk_group=meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0) if grouped else 1,
    )


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The file's weights, with a zero selection bias for each layer with experts whose
    file has none (llama.cpp's: exp_probs_b is optional). `weight_type` is the loader's
    Weight."""
    import torch

    out = dict(weights)
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        bias = f"model.layers.{layer}.{_BIAS_KEY}"
        if bias not in out:
            out[bias] = weight_type(torch.zeros(config["n_routed_experts"]))
    return out
