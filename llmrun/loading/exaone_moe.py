"""EXAONE MoE (K-EXAONE) at the loader edge: Hub folders and llama.cpp's "exaone-moe"
GGUFs, as the config and tensor names of llmrun's exaone_moe model.

Hub checkpoints name the selection bias mlp.e_score_correction_bias (transformers
renames it into the router), hold multi-token-prediction weights under mtp.*, which
transformers ignores, and, saved by transformers 5, stacked experts.

GGUFs are read as llama.cpp's converter writes them (conversion/exaone.py
ExaoneMoEModel: Exaone4Model's keys, the window and its per-layer flags, the experts'
widths and counts, weights scale and norm, leading_dense_block_count,
nextn_predict_layers with the MTP layers last in block_count, experts stacked, the
selection bias as exp_probs_b.bias) and as src/models/exaone-moe.cpp reads them: a
window of 128 and load_swa_pattern(ml, 4) where the file has none, RoPE on the
sliding layers alone (with rope.freq_base_swa where given), pre-norms (ffn_norm
before the feed-forward), no scale where expert_weights_scale is 0 or absent, no
renormalization where expert_weights_norm is absent, the shared experts
expert_shared_feed_forward_length wide (else an expert's width), no grouped routing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "exaone-moe", "exaone_moe"
SLIDING_WINDOW = 128  # llama_model_exaone_moe::load_arch_hparams: n_swa where the file has none
SWA_PATTERN = 4  # load_swa_pattern(ml, 4): every fourth layer global
_FFN_NORM = TENSOR_NAMES[MODEL_TENSOR.FFN_NORM].split(".")[-1]
_HUB_BIAS = re.compile(r"(model\.layers\.\d+\.mlp)\.e_score_correction_bias")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """A Hub folder's weights under llmrun's keys: the selection bias in the router,
    stacked experts split, the multi-token-prediction weights (mtp.*) left out."""
    out = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        match = _HUB_BIAS.fullmatch(name)
        out[f"{match.group(1)}.gate.e_score_correction_bias" if match else name] = w
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 1024)
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for an exaone-moe layer tensor, or None where it is not one."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] == _FFN_NORM:
        return f"model.layers.{parts[1]}.post_attention_layernorm.{parts[3]}"
    return glm4_moe.hf_name(gguf_name)


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A zero selection bias for the expert layers of a file without one (llama.cpp's
    exp_probs_b is optional: no bias then)."""
    import torch

    out = dict(weights)
    for layer, kind in enumerate(config["mlp_layer_types"]):
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if kind == "sparse" and bias not in out:
            out[bias] = weight_type(torch.zeros(config["num_experts"]))
    return out


def finish_config(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    layer_types: Callable[..., list[str]],
) -> None:
    """EXAONE MoE's fields of the HF-style config that config_from_gguf built, as
    llama_model_exaone_moe::load_arch_hparams reads them (`layer_types` is gguf_config's
    reader of llama.cpp's window pattern). Refuses what llama.cpp runs otherwise than
    transformers: grouped routing that would choose among groups, a gating function
    other than sigmoid, partial RoPE, a shared expert width that is not a whole number
    of experts."""
    path = gg.path
    layers, nextn = glm4_moe.trunk_layers(gg, ARCH)
    config.update(num_hidden_layers=layers)
    config[glm4_moe.NEXTN] = nextn
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, int(ExpertGatingFuncType.SIGMOID))
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; EXAONE MoE's experts are gated "
            "by sigmoid"
        )
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 1)
    if groups > 1 and meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, groups) < groups:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GROUP_COUNT)} is {groups} with fewer groups "
            "used; llama.cpp's exaone-moe ignores the groups, transformers chooses among "
            "them, and llmrun does not guess which the model was trained with"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    shared_width = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0) or width
    if shared_width % width:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)} ({shared_width}) "
            f"is not a whole number of experts {width} wide"
        )
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT)
    if rotated and rotated != config["head_dim"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rotated}, not the head size "
            f"{config['head_dim']}; EXAONE MoE rotates whole heads"
        )
    dense = meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    config.update(
        num_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        num_shared_experts=shared_width // width,
        first_k_dense_replace=dense,
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        # 0 (no key): llama.cpp leaves the weights unscaled.
        routed_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        n_group=1,
        topk_group=1,
        hidden_act="silu",
    )
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None:
        config["rope_parameters"]["rope_theta"] = local_base  # the rotating layers' base
    flags = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(flags, list) and len(flags) == layers + nextn:
        # Flags for the MTP layers too: the trunk's come first.
        trunk = {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN): flags[:layers]}
        meta = replace(meta, metadata={**meta.metadata, **trunk})
    config.update(
        sliding_window=meta.get(Keys.Attention.SLIDING_WINDOW) or SLIDING_WINDOW,
        layer_types=layer_types(gg, meta, layers, SWA_PATTERN),
    )
