"""Hunyuan V4 at the loader edge: the Hub's folders, and GGUFs of llama.cpp's arch
"hy_v4" as its converter writes them (conversion/hy_v4.py HYV4Model) and llama.cpp
reads them (src/models/hy-v4.cpp), as the config and tensors of llmrun's hy_v4 model.

The files are deepseek2 ones (llmrun/loading/deepseek2.py: MLA as MQA with kv_b_proj
split into attn_k_b and attn_v_b, stacked experts, RoPE rows unpermuted) with the DSA
indexer's keys and tensors (llmrun/loading/dsa.py; attention.indexer.types, true for a
layer with its own indexer: llama.cpp has no default for it and refuses a file whose
layer 0 is not one), the attention's sinks (attn_sinks) and output gate (attn_gate),
the hyper-connections' tensors (blk.N.hc_{attn,ffn}_{fn,base,scale}, output_hc_*) and
keys (hyper_connection.count, epsilon, magnitude: all required), and the routed
experts' SwiGLU clamp (swiglu_clamp_exp, one per layer; absent or 0: none). The
converter drops n_group = topk_group = 1 and the MTP layers, always writes sigmoid
gating, and leaves expert_weights_norm out where norm_topk_prob is false (llama.cpp:
no renormalization). llama.cpp's hy_v4 graph scales the attention by 1/sqrt(key width)
whatever the RoPE, so YaRN files (whose softmax transformers scales by YaRN's mscale)
are refused, as are files without the indexer (attention.indexer.top_k absent or 0:
llama.cpp then attends to every key; transformers' HY V4 has no such model).

The Hub's keys name the hyper-connections hc_{attn,mlp}_layer.hc_pre.hc_*, the head's
hc_head.hc_head_*, the sinks learnable_sink_param and the gate linear_gate; hf_weights
renames them as transformers does (conversion_mapping.py), splits the stacked experts
and drops the multi-token-prediction layers (mtp_layers). HY V4 VL's folders (hy_v4_vl)
hold the same language model under the same names beside the vision tower (vit.*),
which the loader leaves out (MULTIMODAL); llama.cpp's converter has no arch for them.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2, dsa, experts
from llmrun.loading.gguf_io import ArchMetadata

# gguf-py's MODEL_ARCH.HY_V4 and its keys (newer than the gguf package llmrun depends on).
ARCH = MODEL_TYPE = "hy_v4"
# HY V4 VL's: its language model (llmrun.loading.loader's MULTIMODAL) is HY V4's.
VL_MODEL_TYPE, VL_TEXT_MODEL_TYPE = "hy_v4_vl", "hy_v4_vl_text"
MODEL_TYPES = (MODEL_TYPE, VL_TEXT_MODEL_TYPE)
HC_COUNT = "{arch}.hyper_connection.count"
HC_EPSILON = "{arch}.hyper_connection.epsilon"
HC_MAGNITUDE = "{arch}.hyper_connection.magnitude"
SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"

_ROOT = {
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}
# blk.N.<name> -> the key under model.layers.N., where it is not deepseek2's or DSA's.
_LAYER = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_gate.weight": "self_attn.gate_proj.weight",
}
for _stream in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        _LAYER[f"hc_{_stream}_{_part}.weight"] = f"{_stream}_hc.{_part}"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# The Hub's names -> transformers' (and llmrun's): conversion_mapping.py's renames, in
# its order (transformers' own saves put the hc_pre back in front: model.hc_pre.hc_head.*).
_HUB_NAMES = (
    (re.compile(r"\.hc_pre\.hc_"), ".hc_"),
    (re.compile(r"\.learnable_sink_param"), ".sinks"),
    (re.compile(r"\.linear_gate"), ".gate_proj"),
    (re.compile(r"\.hc_attn_layer\.hc_(fn|base|scale)"), r".attn_hc.\1"),
    (re.compile(r"\.hc_mlp_layer\.hc_(fn|base|scale)"), r".ffn_hc.\1"),
    (re.compile(r"\.hc_head_(fn|base|scale)"), r".hc_\1"),
)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a hy_v4 GGUF tensor, or None if the model has none."""
    if gguf_name in _ROOT:
        return _ROOT[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is not None and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    return dsa.hf_name(gguf_name)


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """An HF-style hy_v4 config from the file's metadata, read as llama_model_hy_v4's
    load_arch_hparams reads it: deepseek2's keys, sigmoid gating, the hyper-connections,
    the routed experts' clamp and the indexer."""
    path, arch = gg.path, gg.architecture
    meta = ArchMetadata.of(gg)

    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GATING_FUNC)} is {gating}; Hunyuan V4's experts "
            f"are sigmoid-gated ({int(ExpertGatingFuncType.SIGMOID)}), as the converter writes"
        )
    config = deepseek2.config_from_gguf(gg, rope_from_gguf)
    if config.get("q_lora_rank") is None:
        raise UnsupportedError(f"{path}: a {arch} file without attn_q_a is not supported")
    if config["rope_parameters"]["rope_type"] != "default":
        raise UnsupportedError(
            f"{path}: RoPE scaling {config['rope_parameters']['rope_type']!r} in a {arch} file "
            "is not supported (llama.cpp's graph does not scale the softmax as transformers "
            "does)"
        )
    layers = config["num_hidden_layers"]
    if not meta.get(Keys.Attention.Indexer.TOP_K):
        raise UnsupportedError(
            f"{path}: a {arch} file without DeepSeek sparse attention "
            f"({meta.name(Keys.Attention.Indexer.TOP_K)}) is not supported"
        )
    heads = meta.get(Keys.Attention.Indexer.HEAD_COUNT, 0)
    width = meta.get(Keys.Attention.Indexer.KEY_LENGTH, 0)
    if not heads or width <= config["qk_rope_head_dim"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Attention.Indexer.HEAD_COUNT)} {heads} and "
            f"{meta.name(Keys.Attention.Indexer.KEY_LENGTH)} {width} do not make an indexer "
            f"(heads, and more features than RoPE's {config['qk_rope_head_dim']})"
        )
    full = meta.get(dsa.INDEXER_TYPES)
    full = full if isinstance(full, list) else [full] * layers  # get_key_or_arr
    if len(full) < layers or not full[0]:
        raise ModelFormatError(
            f"{path}: {meta.name(dsa.INDEXER_TYPES)} is {meta.get(dsa.INDEXER_TYPES)!r}; it "
            f"needs {layers} entries, the first true (layer 0 runs its own indexer)"
        )
    dense = config["first_k_dense_replace"]
    config.update(
        model_type=MODEL_TYPE,
        hc_mult=meta.require(HC_COUNT),
        hc_eps=meta.require(HC_EPSILON),
        hc_magnitude=meta.require(HC_MAGNITUDE),
        swiglu_limit=_clamp(meta.get(SWIGLU_CLAMP_EXP, 0.0), layers, dense, path),
        index_topk=meta.require(Keys.Attention.Indexer.TOP_K),
        index_n_heads=heads,
        index_head_dim=width,
        indexer_types=["full" if f else "shared" for f in full[:layers]],
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
    )
    return config


def _clamp(value: Any, layers: int, dense: int, path: Any) -> float:
    """The routed experts' SwiGLU limit (0: none) from swiglu_clamp_exp, one value or
    one per layer (those of the dense layers unread)."""
    values = value if isinstance(value, list) else [value] * layers
    limits = {float(v) for v in values[dense:layers]}
    if len(values) < layers or len(limits) > 1:
        raise UnsupportedError(
            f"{path}: {SWIGLU_CLAMP_EXP.format(arch=ARCH)} is {value!r}; llmrun runs one "
            "limit for every layer with experts"
        )
    return limits.pop() if limits else 0.0


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """deepseek2's joining of attn_k_b and attn_v_b into kv_b_proj, and its zero selection
    bias where a file has none (the tensor is optional)."""
    return dsa.gguf_weights(weights, config, weight_type)


def hf_weights(weights: dict[str, Any], config: dict[str, Any], path: Any, weight_type: type):
    """A Hub folder's weights under llmrun's keys: the Hub's names as transformers
    renames them, the stacked experts split, the multi-token-prediction layers dropped
    (and a quantized checkpoint refused, deepseek2.hf_weights). `weight_type` is the
    loader's Weight."""
    out = {}
    for key, w in weights.items():
        if key.startswith("model.mtp_layers."):
            continue
        for pattern, new in _HUB_NAMES:
            key = pattern.sub(new, key)
        out[key] = w
    out = deepseek2.hf_weights(out, config, path)
    hidden, width = config["hidden_size"], config.get("moe_intermediate_size", 768)
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)
