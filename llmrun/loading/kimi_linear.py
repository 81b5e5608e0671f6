"""Kimi Linear at the loader edge: Hugging Face folders (Moonshot's checkpoint names, which
transformers 5 saves back) and GGUFs of llama.cpp's arch "kimi-linear" as its converter
writes them (conversion/kimi_linear.py), read as src/models/kimi-linear.cpp reads them,
all as the weights of llmrun.models.kimi_linear.

A checkpoint's feed-forward is `block_sparse_moe` (transformers 5 saves even the dense
layers' so), its experts' projections w1 (gate), w3 (up), w2 (down); the model names them
as DeepSeek's (mlp, gate_proj, up_proj, down_proj). What the converter changes, and how
it is undone: each KDA convolution [channels, 1, kernel] is stored [1, channels, 1,
kernel]; A_log [1, 1, heads, 1] as -exp(A_log) (ssm_a, log(-x) gives it back); dt_bias
as ssm_dt.bias; kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, joined
back as llmrun.loading.deepseek2 joins DeepSeek's; experts stacked. Which layers are KDA
is attention.head_count_kv: 0 for a KDA layer (llama.cpp's is_recr), else MLA. llama.cpp
applies no RoPE to this arch, and always renormalizes the chosen experts' weights.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = "kimi-linear"
MODEL_TYPE = "kimi_linear"


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF tensor (after blk.N., without its suffix) -> the module in the model's layer.
_LAYER_NAMES = {
    _short(t): name
    for t, name in [
        (MODEL_TENSOR.ATTN_K, "self_attn.k_proj"),
        (MODEL_TENSOR.ATTN_V, "self_attn.v_proj"),
        (MODEL_TENSOR.SSM_CONV1D_Q, "self_attn.q_conv1d"),
        (MODEL_TENSOR.SSM_CONV1D_K, "self_attn.k_conv1d"),
        (MODEL_TENSOR.SSM_CONV1D_V, "self_attn.v_conv1d"),
        (MODEL_TENSOR.SSM_F_A, "self_attn.f_a_proj"),
        (MODEL_TENSOR.SSM_F_B, "self_attn.f_b_proj"),
        (MODEL_TENSOR.SSM_BETA, "self_attn.b_proj"),
        (MODEL_TENSOR.SSM_G_A, "self_attn.g_a_proj"),
        (MODEL_TENSOR.SSM_G_B, "self_attn.g_b_proj"),
        (MODEL_TENSOR.SSM_NORM, "self_attn.o_norm"),
    ]
}
_SSM_A = _short(MODEL_TENSOR.SSM_A)  # no .weight: llama.cpp's LLM_TENSOR_SSM_A_NOSCAN
_SSM_DT = _short(MODEL_TENSOR.SSM_DT)  # .bias: HF's dt_bias
_CONV = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
_Q_A = _short(MODEL_TENSOR.ATTN_Q_A)
# A checkpoint's feed-forward names -> the model's (DeepSeek's).
_HF_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."))
_HF_RENAMES += ((".w2.", ".down_proj."),)


def hf_name(gguf_name: str) -> str | None:
    """The model's state-dict key for a kimi-linear GGUF tensor (a stack of experts: a
    template with an `{expert}` field; attn_k_b/attn_v_b: keys gguf_weights joins), or
    None if the model has no such tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] == _SSM_A:
        return f"model.layers.{parts[1]}.self_attn.A_log"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        layer, name = f"model.layers.{parts[1]}", parts[2]
        if name == _SSM_DT and parts[3] == "bias":
            return f"{layer}.self_attn.dt_bias"
        if name in _LAYER_NAMES and parts[3] == "weight":
            return f"{layer}.{_LAYER_NAMES[name]}.weight"
    return deepseek2.hf_name(gguf_name)


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF-style config of a kimi-linear GGUF, read as llama_model_kimi_linear::
    load_arch_hparams reads it (its required keys, its defaults)."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    if any(name.endswith(f".{_Q_A}.weight") for name in gg.tensors):
        raise UnsupportedError(
            f"{path}: a {arch} file with compressed queries ({_Q_A}) is not supported "
            "(llama.cpp reads no q_lora_rank for this arch)"
        )
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not isinstance(heads, int) or heads <= 0:
        raise UnsupportedError(
            f"{path}: {Keys.Attention.HEAD_COUNT.format(arch=arch)} is {heads!r}; llmrun "
            "needs one number"
        )
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(kv_heads) != layers:
        raise ModelFormatError(
            f"{path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=arch)} lists {len(kv_heads)} "
            f"layers, but block_count is {layers}"
        )
    rank = meta.require(Keys.Attention.KV_LORA_RANK)
    rope = meta.require(Keys.Rope.DIMENSION_COUNT)
    qk_head_dim = meta.require(Keys.Attention.KEY_LENGTH_MLA)
    if not 0 < rope < qk_head_dim:
        raise ModelFormatError(
            f"{path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is {rope}, but keys have "
            f"{qk_head_dim} features (attention.key_length_mla)"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab_size(gg, meta),
        "max_position_embeddings": context,
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,  # llama.cpp normalizes the latents with it too
        "kv_lora_rank": rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": qk_head_dim - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": meta.require(Keys.Attention.VALUE_LENGTH_MLA),
        "linear_num_heads": heads,  # llama.cpp's KDA layers have n_head heads
        "linear_head_dim": meta.require(Keys.KDA.HEAD_DIM),
        "linear_conv_kernel_dim": meta.require(Keys.SSM.CONV_KERNEL),
        "layer_types": ["linear_attention" if n == 0 else "full_attention" for n in kv_heads],
        "tie_word_embeddings": "output.weight" not in gg.tensors,
    }
    config.update(expert_fields(gg, meta, layers))
    return config


def expert_fields(gg: GGUFFile, meta: ArchMetadata, layers: int) -> dict[str, Any]:
    """The feed-forward's fields: the leading dense layers, then sigmoid-gated experts
    with a selection bias and shared experts (llama.cpp's graph: renormalized top-k,
    scaled by expert_weights_scale, no expert groups)."""
    arch, path = gg.architecture, gg.path
    dense = meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)} is {used}, but "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=arch)} is {count}"
        )
    gating = meta.require(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)} is {gating}; llmrun's "
            f"{arch} experts are gated by sigmoid ({int(ExpertGatingFuncType.SIGMOID)})"
        )
    width = meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
    if isinstance(width, list):  # one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)} differs "
                "between layers, which llmrun does not support"
            )
        width = width[0]
    fields: dict[str, Any] = {
        "first_k_dense_replace": dense,
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
        "moe_intermediate_size": width,
        "n_routed_experts": count,
        "num_experts_per_tok": used,
        "n_shared_experts": meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        # 0 (no key): llama.cpp leaves the weights unscaled.
        "routed_scaling_factor": meta.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 0.0) or 1.0,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
    }
    if dense:
        fields["intermediate_size"] = meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
    return fields


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The GGUF's weights as the model takes them (see the module docstring): the
    convolutions [channels, 1, kernel], A_log from ssm_a, kv_b_proj joined from
    attn_k_b and attn_v_b. `weight_type` is the loader's Weight."""
    import torch

    heads = config["linear_num_heads"]
    out = {}
    for name, w in weights.items():
        if name.endswith(_CONV):
            if w.ggml_type is not None or w.tensor.numel() % config["linear_conv_kernel_dim"]:
                raise ModelFormatError(
                    f"{name}: the convolution should be float [1, channels, 1, kernel], not "
                    f"{list(w.shape)}"
                )
            w = weight_type(w.tensor.reshape(-1, 1, config["linear_conv_kernel_dim"]))
        elif name.endswith(".A_log"):
            if w.ggml_type is not None or w.tensor.numel() != heads:
                raise ModelFormatError(f"{name}: ssm_a should hold {heads} floats")
            w = weight_type(torch.log(-w.tensor.float()).reshape(1, 1, heads, 1))
        out[name] = w
    return deepseek2.gguf_weights(out, config, weight_type)


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's weights under the model's names: its feed-forward's (see the module
    docstring)."""
    out = {}
    for name, w in weights.items():
        for old, new in _HF_RENAMES:
            name = name.replace(old, new)
        out[name] = w
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a Kimi Linear config.json-style dict keep keys and values (its
    MLA layers; the KDA layers keep a state of fixed size); None for another family.
    transformers' layer_types, else Moonshot's 1-based full_attn_layers, else
    transformers' default (every fourth layer from layer 4)."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind == "full_attention" for kind in kinds)
    full = (config.get("linear_attn_config") or {}).get("full_attn_layers")
    if full is not None:
        return len(full)
    return (int(config["num_hidden_layers"]) - 1) // 4
