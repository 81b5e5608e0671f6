"""Ling 1 and Ling 2.0 at the loader edge: Hugging Face folders (BailingMoeForCausalLM and
BailingMoeV2ForCausalLM, whose config.json files both say model_type "bailing_moe": the
class in `architectures` tells them apart) and GGUFs of llama.cpp's archs "bailingmoe"
and "bailingmoe2" as its converter writes them (conversion/bailingmoe.py
BailingMoeModel, BailingMoeV2Model) and llama.cpp reads them (src/models/bailingmoe.cpp,
bailingmoe2.cpp), as the weights of llmrun.models.bailing_moe and bailing_moe_v2. Sarvam
MoE's folders (model_type sarvam_moe) hold Ling 2.0's names; its GGUFs are bailingmoe2's
(conversion/bailingmoe.py SarvamMoEModel: the whole head's width as rope.dimension_count,
the selection bias shifted to mean zero, which chooses the same experts).

A folder names the embedding model.word_embeddings, each layer's attention `attention`
(its fused query_key_value: all queries' rows, then keys', then values'; its output
projection `dense`; Ling 2.0's q/k norms query_layernorm and key_layernorm) and Ling
2.0's selection bias mlp.gate.expert_bias; the models' names are GLM-4.5 MoE's. Ling 1's
norm_head (the output matrix's columns scaled to unit length by the published code) is
applied to the folder's matrix here. Ling 2.0's published code counts
multi-token-prediction layers inside num_hidden_layers and llama.cpp's converter past
it: a folder that has any is refused rather than guessed.

Ling 1's GGUF: query_key_value split into attn_q, attn_k, attn_v, q and k rows permuted
as a Llama's (undone by the loader: QK_PERMUTED_ARCHS), the output matrix already
normalized where norm_head, experts stacked; llama.cpp requires the expert width and the
shared expert count, scores by softmax and renormalizes where expert_weights_norm says
so. It builds experts in every layer whatever leading_dense_block_count says (a file with
dense layers it does not load; llmrun reads them as the published code runs them).

Ling 2.0's GGUF: query_key_value kept fused as attn_qkv, unpermuted (llama.cpp's NEOX
RoPE turns halves, as the published code does), split here; the norm before the
feed-forward as ffn_norm, expert_bias as exp_probs_b.bias, the experts stacked, the
rotated width as rope.dimension_count, score_function as expert_gating_func, and
block_count as num_hidden_layers + nextn_predict_layers, those layers last (skipped, as
llama.cpp's inference skips them). llama.cpp requires the shared expert count and the
gating function; it scales the weights by expert_weights_scale where the key is there
and renormalizes them where expert_weights_norm says so.

What llama.cpp computes otherwise than the published code is refused: Ling 2.0's gating
other than sigmoid, expert_weights_norm other than "more than one expert a token" (when
Ling's published code renormalizes; Sarvam's does where its config says so, which the
file cannot tell apart), or shared experts' width (expert_shared_feed_forward_length,
else expert_feed_forward_length, times expert_shared_count) other than
expert_feed_forward_length x expert_shared_count; Ling 1's weights scaled, or
renormalized with one expert a token, or RoPE on part of each head.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, V2_ARCH = "bailingmoe", "bailingmoe2"
MODEL_TYPE = "bailing_moe"  # the Hub's config.json says so for Ling 1 and Ling 2.0
V2_MODEL_TYPE = "bailing_moe_v2"  # llmrun's registry name of llmrun.models.bailing_moe_v2
# Sarvam MoE's folders hold Ling 2.0's names (llmrun.models.sarvam_moe); its GGUFs are
# bailingmoe2's.
SARVAM_MODEL_TYPE = "sarvam_moe"
MODEL_TYPES = (MODEL_TYPE, V2_MODEL_TYPE, SARVAM_MODEL_TYPE)
V2_CLASS = "BailingMoeV2ForCausalLM"
NORM_HEAD_EPS = 1e-7  # the published code's
# A folder's names -> the model's, in order.
_HF_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.attention\.query_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.attention\.key_layernorm\."), ".self_attn.k_norm."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
FUSED_QKV = "self_attn.query_key_value"


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF layer tensors whose module glm4_moe.hf_name does not name (before .weight/.bias).
_LAYER_NAMES = {
    _short(MODEL_TENSOR.ATTN_QKV): FUSED_QKV,
    _short(MODEL_TENSOR.FFN_NORM): "post_attention_layernorm",
}


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Ling or Sarvam MoE folder's config (model_type bailing_moe_v2 where
    `architectures` names BailingMoeV2ForCausalLM) and its `weights` ({key: loader
    Weight}) under the model's names, query_key_value split, Ling 1's norm_head applied
    (see the module docstring)."""
    if config["model_type"] == SARVAM_MODEL_TYPE:
        return config, split_qkv(_renamed(weights), config, weight_type)
    v2 = V2_CLASS in (config.get("architectures") or []) or config["model_type"] == V2_MODEL_TYPE
    if v2 and config.get("num_nextn_predict_layers"):
        raise UnsupportedError(
            f"Ling 2.0 with num_nextn_predict_layers {config['num_nextn_predict_layers']} "
            "is not supported: the published code counts those layers in "
            "num_hidden_layers, llama.cpp's converter after them"
        )
    config = {**config, "model_type": V2_MODEL_TYPE if v2 else MODEL_TYPE}
    renamed = _renamed(weights)
    head = renamed.get("lm_head.weight")
    if not v2 and config.get("norm_head") and head is not None:
        w = head.tensor.float()
        renamed["lm_head.weight"] = weight_type(
            w / (w.norm(p=2, dim=0, keepdim=True) + NORM_HEAD_EPS)
        )
    return config, split_qkv(renamed, config, weight_type)


def _renamed(weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` under the model's names but query_key_value (_HF_RENAMES)."""
    renamed = {}
    for key, weight in weights.items():
        for pattern, new in _HF_RENAMES:
            key = pattern.sub(new, key)
        renamed[key] = weight
    return renamed


def hf_name(gguf_name: str) -> str | None:
    """The model's state-dict key for a layer tensor of a bailingmoe, bailingmoe2 or
    deepseek GGUF (a stack of experts: a template with an `{expert}` field; attn_qkv: the
    fused key split_qkv splits), or None if the model has no such tensor."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return glm4_moe.hf_name(gguf_name)


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Ling 1's fields of the HF-style config that config_from_gguf built, read as
    llama_model_bailingmoe::load_arch_hparams reads them (see the module docstring)."""
    path, arch = gg.path, gg.architecture
    expert_fields(gg, config, meta)
    scale = meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedError(
            f"{path}: {arch}.expert_weights_scale is {scale}; Ling 1's expert weights are "
            "not scaled"
        )
    if config["norm_topk_prob"] and config["num_experts_per_tok"] == 1:
        raise UnsupportedError(
            f"{path}: {arch}.expert_weights_norm with one expert a token: llama.cpp weighs "
            "it 1, the published code by its score; llmrun does not guess which is meant"
        )
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated != head_dim:
        raise UnsupportedError(
            f"{path}: {arch}.rope.dimension_count is {rotated}, but Ling 1 turns whole heads "
            f"of {head_dim}"
        )
    config["rope_parameters"]["partial_rotary_factor"] = 1.0
    # Folders' configs must say it (BailingMoeConfig's default is true); a GGUF has none.
    config["use_bias"] = False


def finish_v2_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Ling 2.0's fields of the HF-style config that config_from_gguf built, read as
    llama_model_bailingmoe2::load_arch_hparams reads them (see the module docstring)."""
    path, arch = gg.path, gg.architecture
    layers, nextn = glm4_moe.trunk_layers(gg, arch)
    config.update(num_hidden_layers=layers, use_qk_norm=True)
    config[glm4_moe.NEXTN] = nextn
    gating = _required(gg, meta, Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{path}: {Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; Ling 2.0's experts are scored by "
            "sigmoid"
        )
    expert_fields(gg, config, meta)
    width, shared = config["moe_intermediate_size"], config["n_shared_experts"]
    shared_width = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
    if shared and (shared_width or width) * shared != width * shared:
        raise UnsupportedError(
            f"{path}: llama.cpp's shared experts here are {(shared_width or width) * shared} "
            f"wide ({arch}.expert_shared_feed_forward_length x expert_shared_count), the "
            f"published model's {width * shared} (expert_feed_forward_length x "
            "expert_shared_count); llmrun does not guess which is meant"
        )
    used = config["num_experts_per_tok"]
    if config["norm_topk_prob"] != (used > 1):
        raise UnsupportedError(
            f"{path}: {arch}.expert_weights_norm is {config['norm_topk_prob']} with {used} "
            "experts a token: Ling 2.0's published code renormalizes the weights exactly "
            "when a token takes more than one expert, Sarvam MoE's where its config says "
            "so; llmrun does not guess which model this is"
        )
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0)
    grouped = groups > 1  # llama.cpp ignores one group or none
    config.update(
        # 0 (no key): llama.cpp leaves the weights unscaled.
        routed_scaling_factor=meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        n_group=groups if grouped else 1,
        topk_group=meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0) if grouped else 1,
    )
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or head_dim
    if rotated % 2 or rotated > head_dim:
        raise ModelFormatError(
            f"{path}: {arch}.rope.dimension_count is {rotated}, but RoPE rotates pairs of "
            f"the {head_dim} features of a head"
        )
    config["rope_parameters"]["partial_rotary_factor"] = rotated / head_dim
    config["attention_bias"] = f"blk.0.{_short(MODEL_TENSOR.ATTN_QKV)}.bias" in gg.tensors


def _required(gg: GGUFFile, meta: ArchMetadata, template: str) -> Any:
    value = meta.get(template)
    if value is None:
        raise ModelFormatError(
            f"{gg.path}: metadata {template.format(arch=gg.architecture)!r} is missing"
        )
    return value


def expert_fields(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """The experts that bailingmoe, bailingmoe2 and deepseek read alike: their count, how many a token takes, their
    width (one for every layer), the shared count, the leading dense layers and whether
    the weights are renormalized."""
    path, arch = gg.path, gg.architecture
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {arch}.expert_used_count is {used}, but {arch}.expert_count is {count} "
            f"(each token needs 1 to {count} experts)"
        )
    width = _required(gg, meta, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {arch}.expert_feed_forward_length differs between layers, which "
                "llmrun does not support"
            )
        width = width[0]
    config.update(
        n_routed_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        n_shared_experts=_required(gg, meta, Keys.LLM.EXPERT_SHARED_COUNT),
        first_k_dense_replace=meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
    )


def split_qkv(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """`weights` with each fused query_key_value (weight or bias; rows of all queries,
    then keys, then values) split into q_proj, k_proj and v_proj rows (views of the
    file's; whole rows of a quantized tensor's blocks). `weight_type` wraps a tensor
    (loader.Weight)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q_rows = heads * head_dim
    kv_rows = (config.get("num_key_value_heads") or heads) * head_dim
    out = {}
    for key, w in weights.items():
        if f".{FUSED_QKV}." not in key:
            out[key] = w
            continue
        if w.shape[0] != q_rows + 2 * kv_rows:
            raise ModelFormatError(
                f"tensor {key} (query_key_value) has {w.shape[0]} rows, but the heads make "
                f"{q_rows} query rows and {kv_rows} key and value rows each"
            )
        start = 0
        for part, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            piece = w.tensor.narrow(0, start, rows)
            shape = (rows, *w.shape[1:])
            out[key.replace(FUSED_QKV, f"self_attn.{part}")] = weight_type(
                piece, w.ggml_type, shape
            )
            start += rows
    return out
