"""GLM-5-Next at the loader edge: the Hub's folders, and GGUFs of llama.cpp's arch
"glm5-next" as its converter writes them (conversion/glm.py Glm5NextModel) and llama.cpp
reads them (src/models/glm5-next.cpp), as llmrun's glm5_next model takes them.

The Hub (and transformers' save_pretrained) name each layer's hyper-connections
hc_attn_fn, hc_attn_base, hc_attn_scale (hc_ffn_* likewise) where the modules are
attn_hc.fn, ... (transformers' conversion_mapping.py renames them so too); experts come
one module per expert, or stacked as transformers 5 holds them (split here). A
multimodal folder's language model is taken by the loader (MULTIMODAL), the vision
tower (model.visual.*) left out. The multi-token-prediction layer past
num_hidden_layers, which transformers ignores, is dropped.

A GGUF is Kimi Linear's for the KDA layers (llmrun.loading.kimi_linear: q/k/v
convolutions as [1, channels, 1, kernel], A_log as -exp(A_log) in ssm_a, dt_bias as
ssm_dt.bias; attention.head_count_kv 0 marks a KDA layer, 1 an indexed one) and
deepseek2's for the latent attention and the experts (kv_b_proj split per head into
attn_k_b and attn_v_b, stacked experts), with DSA's indexer tensors (llmrun.loading.dsa)
and its pools' (indexer_compressor_gate, indexer_compressor_ape), the hyper-connections'
as blk.N.hc_{attn,ffn}_{fn,base,scale}.weight, all as the checkpoint holds them. Keys
llama.cpp requires are required here: the latent ranks and MLA widths, the KDA head
width and kernel, the indexer's heads, width, top-k and pool, the hyper-connections'
count, Sinkhorn iterations and epsilon, the experts' width and shared count. Where
llama.cpp has a default, it is taken: no kda.gate_lower_bound, Kimi's unbounded decay;
no swiglu_clamp_exp (or 0), no clamp; no indexer.types, every layer full; no
expert_weights_norm, no renormalization; no expert_gating_func, sigmoid. A file whose
attention has RoPE, whose indexer skips the tail or whose indexer key norm is not
llama.cpp's and transformers' 1e-6 is refused. The multi-token-prediction layers
(nextn_predict_layers, counted in block_count) are skipped, as llama.cpp's inference
skips them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from gguf import ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import dsa, experts, kimi_linear
from llmrun.loading.gguf_io import ArchMetadata, vocab_size
from llmrun.loading.glm4_moe import NEXTN, trunk_layers

# Mirrors llmrun.models.glm5_next.MODEL_TYPES (this module must not import torch).
MODEL_TYPES = ("glm5_next", "glm5_next_text")
ARCH, GGUF_MODEL_TYPE = "glm5-next", "glm5_next_text"
# gguf 0.19 lacks these keys; llama.cpp's constants.py spells them so.
INDEXER_KPOOL = "{arch}.attention.indexer.kpool"
INDEXER_KPOOL_SELECT_TAIL = "{arch}.attention.indexer.kpool_select_tail"
KDA_GATE_LOWER_BOUND = "{arch}.kda.gate_lower_bound"
SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"
SWIGLU_CLAMP_SHEXP = "{arch}.swiglu_clamp_shexp"
HC_COUNT = "{arch}.hyper_connection.count"
HC_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
HC_EPSILON = "{arch}.hyper_connection.epsilon"
INDEXER_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)
# blk.N.<name>.weight -> the key under model.layers.N. (gguf 0.19 lacks the tensors).
_GGUF_LAYER = {
    "indexer_compressor_gate": "self_attn.indexer.index_kpool_compress_gate",
    "indexer_compressor_ape": "self_attn.indexer.index_kpool_compress_ape",
}
for _stream in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        _GGUF_LAYER[f"hc_{_stream}_{_part}"] = f"{_stream}_hc.{_part}"
_HYPER = re.compile(r"(model\.layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text model's config without transformers' head_dim (the RoPE part's width,
    0 here: no size of the model), and `weights` ({key: loader Weight}) under the
    model's names."""
    config = {k: v for k, v in config.items() if k != "head_dim"}
    return config, hf_weights(weights, config, weight_type)


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], weight_type: type
) -> dict[str, Any]:
    """`weights` under the model's names; `config` the text model's."""
    layers = config.get("num_hidden_layers", 45)
    renamed = {}
    for key, weight in weights.items():
        layer = _LAYER.match(key)
        if layer is not None and int(layer.group(1)) >= layers:
            continue
        hyper = _HYPER.fullmatch(key)
        if hyper is not None:
            key = f"{hyper.group(1)}.{hyper.group(2)}_hc.{hyper.group(3)}"
        renamed[key] = weight
    hidden, width = config.get("hidden_size", 4096), config.get("moe_intermediate_size", 2048)
    return experts.split_stacked(renamed, _STACKED, hidden, width, weight_type)


def cache_layout(text: dict[str, Any]) -> tuple[list[tuple[int, int]], list[int | None]]:
    """The KV cache's layers of a GLM-5-Next text config (its indexed attention layers;
    the KDA layers keep a state of fixed size), for llmrun show: each one head of the
    latent, the indexer's key and its pool gate scores, no window."""
    layers = int(text.get("num_hidden_layers", 45))
    kinds = text.get("layer_types") or [
        "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
    ]
    attending = sum(kind != "linear_attention" for kind in kinds)
    width = int(text.get("kv_lora_rank", 512)) + 2 * int(text.get("index_head_dim", 128))
    return [(1, width)] * attending, [None] * attending


def hf_name(gguf_name: str) -> str | None:
    """The model's state-dict key for a glm5-next GGUF tensor (a stack of experts: a
    template with an `{expert}` field; attn_k_b/attn_v_b: keys gguf_weights joins), or
    None if the model has no such tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        name = _GGUF_LAYER.get(parts[2])
        if name is not None:
            return f"model.layers.{parts[1]}.{name}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] == "indexer":
        return dsa.hf_name(gguf_name)
    return kimi_linear.hf_name(gguf_name)


def config_from_gguf(gg) -> dict[str, Any]:
    """The HF-style glm5_next_text config of a glm5-next GGUF, read as
    llama_model_glm5_next::load_arch_hparams reads it (see the module docstring)."""
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
    rope = meta.get(Keys.Rope.DIMENSION_COUNT, 0)
    if rope:
        raise UnsupportedError(
            f"{path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is {rope}; GLM-5-Next's "
            "attention has no RoPE, as transformers requires"
        )
    if not meta.get(INDEXER_KPOOL_SELECT_TAIL, True):
        raise UnsupportedError(
            f"{path}: {INDEXER_KPOOL_SELECT_TAIL.format(arch=arch)} is false, which llmrun "
            "does not support (a query would attend to no token before its first pool)"
        )
    norm_eps = meta.require(Keys.Attention.LAYERNORM_EPS)
    if abs(norm_eps - INDEXER_NORM_EPS) > 1e-12:
        raise UnsupportedError(
            f"{path}: {Keys.Attention.LAYERNORM_EPS.format(arch=arch)} is {norm_eps}; "
            f"llmrun's indexer key norm is transformers' ({INDEXER_NORM_EPS})"
        )
    eps = meta.require(Keys.Attention.LAYERNORM_RMS_EPS)
    full = meta.get(dsa.INDEXER_TYPES, [True] * layers)
    full = full if isinstance(full, list) else [full] * layers
    config: dict[str, Any] = {
        "model_type": GGUF_MODEL_TYPE,
        "hidden_size": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": layers,
        NEXTN: nextn,
        "num_attention_heads": heads,
        "vocab_size": vocab_size(gg, meta),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "rms_norm_eps": eps,
        "latent_norm_eps": eps,
        "q_lora_rank": meta.require(Keys.Attention.Q_LORA_RANK),
        "kv_lora_rank": meta.require(Keys.Attention.KV_LORA_RANK),
        "qk_nope_head_dim": meta.require(Keys.Attention.KEY_LENGTH_MLA),
        "qk_rope_head_dim": 0,
        "v_head_dim": meta.require(Keys.Attention.VALUE_LENGTH_MLA),
        "linear_num_heads": heads,  # llama.cpp's KDA layers have n_head heads
        "linear_head_dim": meta.require(Keys.KDA.HEAD_DIM),
        "linear_conv_kernel_dim": meta.require(Keys.SSM.CONV_KERNEL),
        "linear_lower_bound": meta.get(KDA_GATE_LOWER_BOUND),
        "layer_types": [
            "linear_attention" if n == 0 else "indexed_attention" for n in kv_heads[:layers]
        ],
        "index_n_heads": meta.require(Keys.Attention.Indexer.HEAD_COUNT),
        "index_head_dim": meta.require(Keys.Attention.Indexer.KEY_LENGTH),
        "index_topk": meta.require(Keys.Attention.Indexer.TOP_K),
        "index_kpool": meta.require(INDEXER_KPOOL),
        "indexer_types": ["full" if f else "shared" for f in full[:layers]],
        "hc_mult": meta.require(HC_COUNT),
        "hc_sinkhorn_iters": meta.require(HC_SINKHORN_ITERATIONS),
        "hc_eps": meta.require(HC_EPSILON),
        "swiglu_limit": _swiglu_limit(meta, layers, path, arch),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
    }
    gating = meta.name(Keys.LLM.EXPERT_GATING_FUNC)
    if gating not in meta.metadata:  # llama.cpp's default for this arch
        meta = replace(meta, metadata={**meta.metadata, gating: int(ExpertGatingFuncType.SIGMOID)})
    config.update(kimi_linear.expert_fields(gg, meta, layers))
    config["norm_topk_prob"] = bool(meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False))
    return config


def _swiglu_limit(meta: ArchMetadata, layers: int, path, arch: str) -> float:
    """The one clamp of every SwiGLU (llama.cpp's swiglu_clamp_exp for the routed
    experts, swiglu_clamp_shexp, else the same, for the shared and dense ones); none
    (infinite) where the keys are absent or 0, as llama.cpp reads them."""
    limits = set()
    for template in (SWIGLU_CLAMP_EXP, SWIGLU_CLAMP_SHEXP):
        values = meta.get(template)
        if values is None:
            continue
        values = values if isinstance(values, list) else [values] * layers
        limits |= {v if v > 1e-6 else float("inf") for v in values[:layers]}
    if len(limits) > 1:
        raise UnsupportedError(
            f"{path}: {arch}'s SwiGLU clamps differ between layers or experts "
            f"({sorted(limits)}), which llmrun does not support (transformers has one)"
        )
    return limits.pop() if limits else float("inf")


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The GGUF's weights as the model takes them: A_log from ssm_a as one value per head,
    the rest as Kimi Linear's file gives them (convolutions, kv_b_proj joined)."""
    heads = config["linear_num_heads"]
    out = kimi_linear.gguf_weights(weights, config, weight_type)
    # kimi_linear's A_log is [1, 1, heads, 1]; this family's [heads].
    return {
        name: weight_type(w.tensor.reshape(heads)) if name.endswith(".A_log") else w
        for name, w in out.items()
    }
