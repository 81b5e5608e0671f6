"""Step 3.5 at the loader edge: Hugging Face folders and llama.cpp's "step35" GGUFs, as
the config and weights of llmrun's step3p5 model.

StepFun's checkpoints (Step3p5ForCausalLM) hold a layer's experts under moe.*: the
router moe.gate.weight, its selection bias moe.router_bias, and each projection stacked
over the experts (moe.gate_proj/up_proj.weight [E, I, D], moe.down_proj.weight
[E, D, I]); the shared expert under share_expert.*; and the multi-token-prediction
layers after the last layer (model.layers.{num_hidden_layers + i}), which are skipped
as transformers skips them. transformers 5's names (mlp.experts.gate_up_proj,
mlp.shared_experts, mlp.gate.e_score_correction_bias) are read too.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

# As llmrun.models.base and llmrun.models.step3p5 name them (not imported: `llmrun list`
# and `show` read this module without torch).
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")

MODEL_TYPE = "step3p5"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_HUB = (
    (re.compile(r"\.moe\.gate\.weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.moe\.router_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.moe\.(gate_proj|up_proj|down_proj)\.weight$"), r".mlp.experts.\1"),
    (re.compile(r"\.share_expert\."), ".mlp.shared_experts."),
)
_EXPERTS = r"(model\.layers\.\d+\.mlp\.experts)"
_STACKED = re.compile(_EXPERTS + r"\.(gate_up_proj|down_proj)")
_HUB_STACKED = re.compile(_EXPERTS + r"\.(gate_proj|up_proj)")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """A Hub folder's weights under llmrun's keys: the trunk's layers only, the experts
    one module each."""
    layers = config["num_hidden_layers"]
    renamed = {}
    for name, w in weights.items():
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= layers:
            continue
        for pattern, replacement in _HUB:
            name = pattern.sub(replacement, name)
        renamed[name] = w
    hidden = config["hidden_size"]
    width = config.get("moe_intermediate_size", 1280)
    return _split(renamed, hidden, width, weight_type)


def _split(weights: dict[str, Any], hidden: int, width: int, weight_type: type) -> dict:
    """Stacked experts split into experts.N.{gate,up,down}_proj.weight: transformers'
    gate_up_proj and down_proj through experts.split_stacked, StepFun's separate gate
    and up stacks here."""
    out = {}
    for key, w in weights.items():
        match = _HUB_STACKED.fullmatch(key)
        if match is None:
            out[key] = w
            continue
        if w.tensor.dim() != 3 or tuple(w.tensor.shape[1:]) != (width, hidden):
            raise ModelFormatError(
                f"{key} has shape {list(w.tensor.shape)}, but the config implies "
                f"[experts, {width}, {hidden}] (moe_intermediate_size, hidden_size)"
            )
        for e in range(w.tensor.shape[0]):
            out[f"{match.group(1)}.{e}.{match.group(2)}.weight"] = weight_type(w.tensor[e])
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)


# GGUFs ------------------------------------------------------------------------------
# As llama.cpp's converter writes them (conversion/step3.py Step35Model: TextModel's keys,
# head_count and head_count_kv per layer, sliding_window and its per-layer flags,
# rope.freq_base_swa, the experts' counts and widths, expert_weights_scale and _norm,
# swiglu_clamp_exp/_shexp per layer, nextn_predict_layers with the MTP layers last in
# block_count, every *norm.weight stored as 1 + w, g_proj as attn_gate), read as
# src/models/step35.cpp reads them: a layer has experts where it has ffn_gate_inp; the
# global layers rotate half of rope.dimension_count (the head size where absent), the
# sliding ones rope.dimension_count_swa (else all of rope.dimension_count); scores by
# sigmoid where expert_gating_func is absent, renormalized only where
# expert_weights_norm says so, scaled only by a given expert_weights_scale; the
# attention scale 1/sqrt(key_length).

ARCH = "step35"
_GATE = TENSOR_NAMES[MODEL_TENSOR.ATTN_GATE].split(".")[-1]
_FFN_NORM = TENSOR_NAMES[MODEL_TENSOR.FFN_NORM].split(".")[-1]
_ROUTER = TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP].split(".")[-1]


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a step35 layer tensor (a stack of experts: a template with an
    `{expert}` field), or None where it is not one."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer = f"model.layers.{parts[1]}"
        if parts[2] == _GATE:
            return f"{layer}.self_attn.g_proj.weight"
        if parts[2] == _FFN_NORM:
            return f"{layer}.post_attention_layernorm.weight"
    return glm4_moe.hf_name(gguf_name)


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF-style config (transformers' Step3p7TextConfig names) of a step35 GGUF."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    layers, nextn = glm4_moe.trunk_layers(gg, ARCH)

    def per_layer(name: str, value: Any) -> list:
        # llama.cpp's get_key_or_arr: one value, or one per layer (MTP layers last).
        if not isinstance(value, list):
            return [value] * layers
        if len(value) < layers:
            raise ModelFormatError(f"{path}: {ARCH}.{name} lists {len(value)} of {layers} layers")
        return value[:layers]

    flags = meta.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    flags = per_layer("attention.sliding_window_pattern", flags)
    layer_types = [LAYER_TYPES[bool(f)] for f in flags]
    heads = per_layer("attention.head_count", meta.require(Keys.Attention.HEAD_COUNT))
    kv = per_layer("attention.head_count_kv", meta.get(Keys.Attention.HEAD_COUNT_KV, heads))
    by_type = {
        t: {h for h, k in zip(heads, layer_types, strict=True) if k == t} for t in LAYER_TYPES
    }
    if len(set(kv)) != 1 or any(len(h) > 1 for h in by_type.values()):
        raise UnsupportedError(
            f"{path}: head counts {heads} and key/value heads {kv} per layer; llmrun runs "
            "Step 3.5 with one head count per layer type and one key/value head count"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads[0]
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: values of another width than the keys' are not supported")
    for name in ("attn_gate", "attn_q_norm", "attn_k_norm"):
        if f"blk.0.{name}.weight" not in gg.tensors:
            raise UnsupportedError(f"{path}: a step35 model without {name} is not supported")
    if "rope_freqs.weight" in gg.tensors or meta.get(Keys.Rope.SCALING_TYPE, "none") != "none":
        raise UnsupportedError(f"{path}: Step 3.5 with RoPE scaling is not supported")
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SIGMOID)
    if gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {ARCH}.expert_gating_func {gating} (not sigmoid) is not supported"
        )
    widths = set(
        per_layer("expert_feed_forward_length", meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    )
    if len(widths) != 1:
        raise UnsupportedError(
            f"{path}: expert widths per layer ({sorted(widths)}) are not supported"
        )
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT, head_dim)
    rotated_swa = meta.get(Keys.Rope.DIMENSION_COUNT_SWA, rotated)
    theta = meta.get(Keys.Rope.FREQ_BASE, 10000.0)
    ropes = {
        "full_attention": (theta, rotated // 2),
        "sliding_attention": (meta.get(Keys.Rope.FREQ_BASE_SWA, theta), rotated_swa),
    }
    full_heads, swa_heads = (next(iter(by_type[t]), None) for t in LAYER_TYPES)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    config = {
        "model_type": MODEL_TYPE,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens else embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        glm4_moe.NEXTN: nextn,
        "num_attention_heads": full_heads or swa_heads,
        "num_sliding_attention_heads": swa_heads or full_heads,
        "num_key_value_heads": kv[0],
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "layer_types": layer_types,
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "mlp_layer_types": [
            MLP_TYPES[f"blk.{i}.{_ROUTER}.weight" in gg.tensors] for i in range(layers)
        ],
        "n_routed_experts": meta.get(Keys.LLM.EXPERT_COUNT, 0),
        "num_experts_per_tok": meta.get(Keys.LLM.EXPERT_USED_COUNT, 0),
        "moe_intermediate_size": widths.pop(),
        "share_expert_dim": meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        "moe_router_scaling_factor": meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        "norm_expert_weight": bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        "swiglu_limits": per_layer("swiglu_clamp_exp", meta.get(Keys.LLM.SWIGLU_CLAMP_EXP, 0.0)),
        "swiglu_limits_shared": per_layer(
            "swiglu_clamp_shexp", meta.get(Keys.LLM.SWIGLU_CLAMP_SHEXP, 0.0)
        ),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": {
            kind: {
                "rope_type": "default",
                "rope_theta": base,
                "partial_rotary_factor": n / head_dim,
            }
            for kind, (base, n) in ropes.items()
        },
    }
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A zero selection bias for the expert layers of a file without one (llama.cpp's
    exp_probs_b is optional: no bias then)."""
    import torch

    out = dict(weights)
    for layer, kind in enumerate(config["mlp_layer_types"]):
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if kind == "sparse" and bias not in out:
            out[bias] = weight_type(torch.zeros(config["n_routed_experts"]))
    return out
