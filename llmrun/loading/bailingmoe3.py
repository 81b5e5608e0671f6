"""Ling 3 at the loader edge: Hugging Face folders (the Hub's BailingMoeV3 names, which
transformers 5 saves back) and GGUFs of llama.cpp's arch "bailingmoe3" as its converter
writes them (conversion/bailingmoe3.py BailingMoeV3Model) and llama.cpp reads them
(src/models/bailingmoe3.cpp), as the weights of llmrun.models.bailing_hybrid.

A folder names the embedding model.word_embeddings, each layer's mixer `attention` (its
output projection `dense`), the routers' selection bias mlp.gate.expert_bias, and holds
one module per expert; the model's names are transformers' (embed_tokens, self_attn,
o_proj, e_score_correction_bias), as transformers' conversion_mapping.py renames them.
A transformers state dict's fused KDA convolution (conv1d) and forget_gate module, and
stacked experts, are taken too. The multi-token-prediction layers past
num_hidden_layers, which transformers ignores, are dropped.

What the converter changes, and how it is undone: each KDA convolution [channels, 1,
kernel] is stored [1, channels, 1, kernel]; A_log [heads] as exp(A_log) (ssm_a [heads,
1]: positive, unlike Kimi Linear's -exp); dt_bias as ssm_dt.bias; the KDA layers' f_proj
and g_proj as ssm_f_a and ssm_g_a, the MLA layers' g_proj (one gate per head) as
attn_gate; kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, joined back
as llmrun.loading.deepseek2 joins DeepSeek's; experts stacked; expert_bias as
exp_probs_b.bias. Which layers are KDA is attention.head_count_kv: 0 for a KDA layer
(llama.cpp's is_recr), 1 for an MLA one. The keys llama.cpp requires are required here
(kda.gate_lower_bound, the MLA widths, the experts' width and shared count, the gating
function); where it has a default, it is taken: no q_lora_rank, queries from attn_q; no
expert_weights_norm, no renormalization; no expert_group_count, no groups; no swiglu
clamps, none. What llama.cpp computes otherwise than transformers is refused: unbounded
KDA gates (kda.safe_gate false, which llama.cpp asserts against), RoPE scaling and M-RoPE
sections (Ling 3 VL), a shared-experts width other than moe_intermediate_size x their
count, and a SwiGLU clamp on a dense layer (llama.cpp clamps the dense feed-forward by
swiglu_clamp_shexp; transformers never clamps it). The multi-token-prediction layers
(nextn_predict_layers, counted in block_count) are skipped, as llama.cpp's inference
skips them.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2, experts, kimi_linear
from llmrun.loading.gguf_io import ArchMetadata, vocab_size
from llmrun.loading.glm4_moe import NEXTN, trunk_layers

ARCH = "bailingmoe3"
# Mirrors llmrun.models.bailing_hybrid.MODEL_TYPES (this module must not import torch).
MODEL_TYPES = ("bailing_hybrid", "bailing_moe_v3")
MODEL_TYPE = MODEL_TYPES[0]
# gguf 0.19 lacks these keys; llama.cpp's constants.py spells them so.
KDA_SAFE_GATE = "{arch}.kda.safe_gate"
KDA_GATE_LOWER_BOUND = "{arch}.kda.gate_lower_bound"
SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"
SWIGLU_CLAMP_SHEXP = "{arch}.swiglu_clamp_shexp"
ROPE_SECTIONS = "{arch}.rope.dimension_sections"
ROPE_SCALING = "{arch}.rope.scaling.type"
CLAMP_EPS = 1e-6  # llama.cpp's: a limit at most this is no clamp


def _short(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF tensors (after blk.N., before .weight) the converter names otherwise than Kimi
# Linear's and DeepSeek's -> the module in the model's layer.
_LAYER_NAMES = {
    _short(MODEL_TENSOR.SSM_F_A): "self_attn.f_proj",
    _short(MODEL_TENSOR.SSM_G_A): "self_attn.g_proj",
    _short(MODEL_TENSOR.ATTN_GATE): "self_attn.g_proj",
}
_CONV = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
_Q_A = _short(MODEL_TENSOR.ATTN_Q_A)
# A folder's names -> the model's, in order.
_HF_RENAMES = (
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A folder's config without num_key_value_heads (MLA caches one latent head: the
    32 transformers saves whatever the heads means nothing), and its `weights` ({key:
    loader Weight}) under the model's names, without the multi-token-prediction layers
    (see the module docstring)."""
    config = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    layers = config["num_hidden_layers"]
    renamed = {}
    for key, weight in weights.items():
        layer = _LAYER.match(key)
        if layer is not None and int(layer.group(1)) >= layers:
            continue
        for pattern, new in _HF_RENAMES:
            key = pattern.sub(new, key)
        if key.endswith(".self_attn.conv1d.weight"):  # transformers' q, k and v convolutions
            base = key.removesuffix("conv1d.weight")
            for name, part in zip("qkv", weight.tensor.chunk(3), strict=True):
                renamed[f"{base}{name}_conv1d.weight"] = weight_type(part)
            continue
        renamed[key] = weight
    hidden = config["hidden_size"]
    width = config.get("moe_intermediate_size", 768)
    return config, experts.split_stacked(renamed, _STACKED, hidden, width, weight_type)


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a Ling 3 config.json-style dict keep keys and values (its MLA
    layers; the KDA layers keep a state of fixed size); None for another family or a
    config that does not say (see llmrun.models.bailing_hybrid)."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind == "full_attention" for kind in kinds)
    layers, group = int(config["num_hidden_layers"]), int(config.get("layer_group_size", 6))
    return layers // group if group > 0 and layers % group == 0 else None


def hf_name(gguf_name: str) -> str | None:
    """The model's state-dict key for a bailingmoe3 GGUF tensor (a stack of experts: a
    template with an `{expert}` field; attn_k_b/attn_v_b: keys gguf_weights joins), or
    None if the model has no such tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        name = _LAYER_NAMES.get(parts[2])
        if name is not None:
            return f"model.layers.{parts[1]}.{name}.weight"
    return kimi_linear.hf_name(gguf_name)


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """The HF-style bailing_hybrid config of a bailingmoe3 GGUF, read as
    llama_model_bailingmoe3::load_arch_hparams reads it (see the module docstring).
    `rope_from_gguf` is gguf_config's reader of the RoPE keys."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    layers, nextn = trunk_layers(gg, arch)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    kv_heads = meta.require(Keys.Attention.HEAD_COUNT_KV)
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * (layers + nextn)
    if len(kv_heads) < layers:
        raise ModelFormatError(
            f"{path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=arch)} lists {len(kv_heads)} "
            f"layers for {layers}"
        )
    if not meta.get(KDA_SAFE_GATE, True):
        raise UnsupportedError(
            f"{path}: {KDA_SAFE_GATE.format(arch=arch)} is false; llama.cpp and llmrun run "
            "this arch's bounded KDA gate only"
        )
    lower_bound = meta.require(KDA_GATE_LOWER_BOUND)
    if not lower_bound < 0:
        raise ModelFormatError(
            f"{path}: {KDA_GATE_LOWER_BOUND.format(arch=arch)} is {lower_bound}; it must be "
            "negative (the least log decay of a step)"
        )
    if meta.get(ROPE_SECTIONS) is not None:
        raise UnsupportedError(
            f"{path}: {ROPE_SECTIONS.format(arch=arch)} (M-RoPE: Ling 3 VL's language model) "
            "is not supported"
        )
    if meta.get(ROPE_SCALING, "none") != "none":
        raise UnsupportedError(
            f"{path}: {ROPE_SCALING.format(arch=arch)} is {meta.get(ROPE_SCALING)!r}; llmrun runs "
            f"{arch} without RoPE scaling (llama.cpp's attention scale takes no YaRN factor)"
        )
    rope = meta.require(Keys.Rope.DIMENSION_COUNT)
    qk_head_dim = meta.require(Keys.Attention.KEY_LENGTH_MLA)
    if not 0 < rope < qk_head_dim:
        raise ModelFormatError(
            f"{path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is {rope}, but keys have "
            f"{qk_head_dim} features (attention.key_length_mla)"
        )
    q_lora_rank = meta.get(Keys.Attention.Q_LORA_RANK) or None
    if q_lora_rank is None and any(name.endswith(f".{_Q_A}.weight") for name in gg.tensors):
        raise ModelFormatError(
            f"{path}: {_Q_A} tensors without {Keys.Attention.Q_LORA_RANK.format(arch=arch)}"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": layers,
        NEXTN: nextn,
        "num_attention_heads": heads,
        "vocab_size": vocab_size(gg, meta),
        "max_position_embeddings": context,
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,  # llama.cpp normalizes the latents with it too
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": meta.require(Keys.Attention.KV_LORA_RANK),
        "qk_nope_head_dim": qk_head_dim - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": meta.require(Keys.Attention.VALUE_LENGTH_MLA),
        "rope_parameters": rope_from_gguf(gg, meta, rope, context),
        "linear_num_heads": heads,  # llama.cpp's KDA layers have n_head heads
        "linear_head_dim": meta.require(Keys.KDA.HEAD_DIM),
        "linear_conv_kernel_dim": meta.require(Keys.SSM.CONV_KERNEL),
        "kda_safe_gate": True,
        "kda_lower_bound": lower_bound,
        "layer_types": [
            "linear_attention" if n == 0 else "full_attention" for n in kv_heads[:layers]
        ],
        "tie_word_embeddings": "output.weight" not in gg.tensors,
    }
    config.update(kimi_linear.expert_fields(gg, meta, layers))
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 0) or 1
    config.update(
        norm_topk_prob=bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        n_group=groups,
        topk_group=meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, 0) if groups > 1 else 1,
    )
    shared_width = meta.get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
    expected = config["moe_intermediate_size"] * config["n_shared_experts"]
    if shared_width and shared_width != expected:
        raise UnsupportedError(
            f"{path}: {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)} is "
            f"{shared_width}; llmrun's (transformers') shared experts are "
            f"expert_feed_forward_length x expert_shared_count ({expected}) wide"
        )
    config["swiglu_limits"] = _limits(meta, SWIGLU_CLAMP_EXP, layers)
    config["swiglu_limits_shared"] = _limits(meta, SWIGLU_CLAMP_SHEXP, layers)
    dense = config["first_k_dense_replace"]
    if any(config["swiglu_limits_shared"][:dense]):
        raise UnsupportedError(
            f"{path}: {SWIGLU_CLAMP_SHEXP.format(arch=arch)} clamps a dense layer's "
            "feed-forward, as llama.cpp would and transformers' Ling 3 never does; llmrun "
            "does not guess which is meant"
        )
    return config


def _limits(meta: ArchMetadata, template: str, layers: int) -> list[float]:
    """Each layer's SwiGLU clamp (0: none) from a per-layer array or one value, as
    llama.cpp reads it (absent: none; at most CLAMP_EPS: none)."""
    values = meta.get(template, 0.0)
    values = values if isinstance(values, list) else [values] * layers
    if len(values) < layers:
        raise ModelFormatError(f"{template} lists {len(values)} layers for {layers}")
    return [float(v) if v > CLAMP_EPS else 0.0 for v in values[:layers]]


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The GGUF's weights as the model takes them (see the module docstring): the
    convolutions [channels, 1, kernel], A_log from ssm_a, kv_b_proj joined from
    attn_k_b and attn_v_b. `weight_type` is the loader's Weight."""
    import torch

    heads, kernel = config["linear_num_heads"], config["linear_conv_kernel_dim"]
    out = {}
    for name, w in weights.items():
        if name.endswith(_CONV):
            if w.ggml_type is not None or w.tensor.numel() % kernel:
                raise ModelFormatError(
                    f"{name}: the convolution should be float [1, channels, 1, kernel], not "
                    f"{list(w.shape)}"
                )
            w = weight_type(w.tensor.reshape(-1, 1, kernel))
        elif name.endswith(".A_log"):
            rates = w.tensor.float()
            if w.ggml_type is not None or rates.numel() != heads or not (rates > 0).all():
                raise ModelFormatError(
                    f"{name}: ssm_a should hold {heads} positive floats, exp(A_log)"
                )
            w = weight_type(torch.log(rates).reshape(heads))
        out[name] = w
    return deepseek2.gguf_weights(out, config, weight_type)
