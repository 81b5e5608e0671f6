"""Gemma 4 checkpoints: Hugging Face folders (the language model of a
Gemma4ForConditionalGeneration, or a Gemma4ForCausalLM) and GGUFs of arch "gemma4" as
llama.cpp's converter writes them (conversion/gemma.py Gemma4Model: Gemma 3's keys with
the norms as they are, not shifted by 1; the global layers' head width as key_length and
the local ones' as key_length_swa; KV heads per layer where global layers have their
own count; the window flags, shared KV layers and per-layer input width (0: none) as
keys; feed_forward_length per layer where the sharing layers' are doubled; one
rope_freqs tensor for the global layers' proportional RoPE: 1 for each turning
frequency, 1e30 for the rest; the router's scale as ffn_gate_inp.scale, each expert's
as ffn_down_exps.scale, the layer's output scale as layer_output_scale; the experts
stacked, gate and up maybe fused).

Where a GGUF leaves a key out, llmrun takes llama.cpp's value (src/models/gemma4.cpp,
src/llama-hparams.h, llama-model.cpp's load_hparams): no shared layers, a final soft-cap
of 30, a local RoPE base of 10000; the keys llama.cpp requires, llmrun requires too.

Both formats may hold keys and values for the sharing layers, which neither
transformers nor llama.cpp reads: they are dropped here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, read_float_list

ARCH = "gemma4"
MODEL_TYPE = "gemma4_text"
# Multimodal, text-only; Gemma 4 Unified's multimodal and its language model.
MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
FINAL_SOFTCAP = 30.0  # f_final_logit_softcapping
ROPE_BASE_SWA = 10000.0  # rope_freq_base_train_swa
UNTURNED = 1e30  # the converter's freq factor of a frequency that does not turn
SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
GLOBAL_EVERY = 6  # transformers' default layer_types: every sixth layer global
CAUSAL_IMAGE_WIDTHS = (1536, 2560)  # E2B's and E4B's: their image tokens attend causally


def _name(tensor: MODEL_TENSOR) -> str:
    return TENSOR_NAMES[tensor].split(".")[-1]


# GGUF name (without its suffix) -> HF key, for the model-wide tensors.
_GLOBAL = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM]: "model.norm",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_TOKEN_EMBD]: "model.embed_tokens_per_layer",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_MODEL_PROJ]: "model.per_layer_model_projection",
    TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_PROJ_NORM]: "model.per_layer_projection_norm",
}
# (a layer's GGUF tensor, its suffix) -> its HF key within model.layers.N.
_LAYER = {
    (_name(MODEL_TENSOR.ATTN_Q), "weight"): "self_attn.q_proj.weight",
    (_name(MODEL_TENSOR.ATTN_K), "weight"): "self_attn.k_proj.weight",
    (_name(MODEL_TENSOR.ATTN_V), "weight"): "self_attn.v_proj.weight",
    (_name(MODEL_TENSOR.ATTN_OUT), "weight"): "self_attn.o_proj.weight",
    (_name(MODEL_TENSOR.ATTN_Q_NORM), "weight"): "self_attn.q_norm.weight",
    (_name(MODEL_TENSOR.ATTN_K_NORM), "weight"): "self_attn.k_norm.weight",
    (_name(MODEL_TENSOR.ATTN_NORM), "weight"): "input_layernorm.weight",
    (_name(MODEL_TENSOR.ATTN_POST_NORM), "weight"): "post_attention_layernorm.weight",
    (_name(MODEL_TENSOR.FFN_PRE_NORM), "weight"): "pre_feedforward_layernorm.weight",
    (_name(MODEL_TENSOR.FFN_POST_NORM), "weight"): "post_feedforward_layernorm.weight",
    (_name(MODEL_TENSOR.FFN_GATE), "weight"): "mlp.gate_proj.weight",
    (_name(MODEL_TENSOR.FFN_UP), "weight"): "mlp.up_proj.weight",
    (_name(MODEL_TENSOR.FFN_DOWN), "weight"): "mlp.down_proj.weight",
    (_name(MODEL_TENSOR.PER_LAYER_INP_GATE), "weight"): "per_layer_input_gate.weight",
    (_name(MODEL_TENSOR.PER_LAYER_PROJ), "weight"): "per_layer_projection.weight",
    (_name(MODEL_TENSOR.PER_LAYER_POST_NORM), "weight"): "post_per_layer_input_norm.weight",
    # The converter adds ".weight" to the buffer's name (Gemma4Model.filter_tensors).
    (_name(MODEL_TENSOR.LAYER_OUT_SCALE), "weight"): "layer_scalar",
    (_name(MODEL_TENSOR.FFN_GATE_INP), "weight"): "router.proj.weight",
    (_name(MODEL_TENSOR.FFN_GATE_INP), "scale"): "router.scale",
    (_name(MODEL_TENSOR.FFN_DOWN_EXP), "scale"): "router.per_expert_scale",
    (_name(MODEL_TENSOR.FFN_PRE_NORM_2), "weight"): "pre_feedforward_layernorm_2.weight",
    (_name(MODEL_TENSOR.FFN_POST_NORM_1), "weight"): "post_feedforward_layernorm_1.weight",
    (_name(MODEL_TENSOR.FFN_POST_NORM_2), "weight"): "post_feedforward_layernorm_2.weight",
    # The experts, stacked: a template of each expert's key (the loader splits them).
    ("ffn_gate_exps", "weight"): "experts.{expert}.gate_proj.weight",
    ("ffn_up_exps", "weight"): "experts.{expert}.up_proj.weight",
    (_name(MODEL_TENSOR.FFN_DOWN_EXP), "weight"): "experts.{expert}.down_proj.weight",
}
# What a sharing layer may have in either format and computes with in neither.
_UNUSED_KV = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")
# transformers' stacked experts of a layer (llmrun.loading.experts).
_STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)")


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a gemma4 GGUF tensor (a stack of experts': a template with an
    {expert} field), or None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL and suffix == "weight":
        return f"{_GLOBAL[base]}.weight"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    name = _LAYER.get((parts[2], suffix))
    return None if name is None else f"model.layers.{parts[1]}.{name}"


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """The HF-style config (Gemma4TextConfig's fields, per_layer_config for the global
    layers' heads) of a gemma4 GGUF."""
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = _uniform(gg, Keys.Attention.HEAD_COUNT, meta.require(Keys.Attention.HEAD_COUNT))
    flags = meta.require(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not isinstance(flags, list) or len(flags) != layers:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=ARCH)} is not a "
            f"list of {layers} layer flags"
        )
    layer_types = [SLIDING if f else FULL for f in flags]
    full_dim = meta.get(Keys.Attention.KEY_LENGTH, hidden // n_heads)
    local_dim = meta.require(Keys.Attention.KEY_LENGTH_SWA)
    for name, value in ((Keys.Attention.VALUE_LENGTH, full_dim),
                        (Keys.Attention.VALUE_LENGTH_SWA, local_dim)):  # fmt: skip
        if meta.get(name, value) != value:
            raise UnsupportedError(
                f"{gg.path}: {name.format(arch=ARCH)} differs from the key length; Gemma 4's "
                "keys and values are as wide"
            )
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads)
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(kv_heads) != layers:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=ARCH)} lists "
            f"{len(kv_heads)} layers, but the model has {layers}"
        )
    local_heads = next((h for h, t in zip(kv_heads, layer_types, strict=True) if t == SLIDING),
                       kv_heads[0])  # fmt: skip
    shared = meta.get(Keys.Attention.SHARED_KV_LAYERS, 0)
    _check_sharing(gg, layer_types, shared)
    per_layer = meta.require(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": local_heads,
        "head_dim": local_dim,
        "per_layer_config": {
            str(i): {
                "head_dim": full_dim if t == FULL else local_dim,
                "num_key_value_heads": kv_heads[i],
            }
            for i, t in enumerate(layer_types)
        },  # fmt: skip
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": len(tokens) if tokens else (embed.shape[0] if embed else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": False,
        "hidden_activation": "gelu_pytorch_tanh",  # its graph's LLM_FFN_GELU
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "layer_types": layer_types,
        "final_logit_softcapping": meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, FINAL_SOFTCAP)
        or None,
        "num_kv_shared_layers": shared,
        "attention_k_eq_v": _keys_are_values(gg, layer_types, shared),
        "hidden_size_per_layer_input": per_layer or None,
        # What image soft tokens embed as before they are placed (llmrun.models.gemma4).
        "pad_token_id": gg.metadata.get(Keys.Tokenizer.PAD_ID, 0),
        # The file does not say whether an image's tokens see each other both ways:
        # llama.cpp's rule (mtmd_decode_use_non_causal), all but E2B's and E4B's widths.
        "use_bidirectional_attention": None if hidden in CAUSAL_IMAGE_WIDTHS else "vision",
        "rope_parameters": {
            SLIDING: _local_rope(gg, meta, local_dim),
            FULL: _global_rope(gg, meta, full_dim),
        },
    }
    if per_layer:
        rows = gg.tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_TOKEN_EMBD]}.weight")
        if rows is None:
            raise ModelFormatError(
                f"{gg.path}: per-layer inputs {per_layer} wide, but no per_layer_token_embd"
            )
        config["vocab_size_per_layer_input"] = int(rows.shape[0])
    config.update(_experts(gg, meta, layers))
    return config


def _uniform(gg: GGUFFile, template: str, value: Any) -> int:
    """A key that may be per layer, which llmrun needs to be one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {template.format(arch=ARCH)} differs between layers, which "
                "llmrun does not support"
            )
        return value[0]
    return value


def _check_sharing(gg: GGUFFile, layer_types: list[str], shared: int) -> None:
    """llama.cpp's sharing layers read the last layer before them (global ones) or the one
    before that (local ones); transformers', the last earlier layer of their type. A file
    where the two differ is refused."""
    first = len(layer_types) - shared
    if shared and (
        first < 2 or layer_types[first - 1] != FULL or layer_types[first - 2] != SLIDING
    ):
        raise UnsupportedError(
            f"{gg.path}: the layers before the {shared} sharing ones are not local then "
            "global, which llama.cpp's Gemma 4 KV sharing assumes"
        )


def _keys_are_values(gg: GGUFFile, layer_types: list[str], shared: int) -> bool:
    """attention_k_eq_v: the global layers that compute keys have no attn_v (llama.cpp
    then takes the keys' projection), and every local one has it."""
    computing = range(len(layer_types) - shared)
    missing = {layer_types[i] for i in computing if f"blk.{i}.attn_v.weight" not in gg.tensors}
    if SLIDING in missing:
        raise UnsupportedError(
            f"{gg.path}: a sliding_attention layer without attn_v; Gemma 4 takes the values "
            "from the keys in global layers only"
        )
    if missing and any(
        f"blk.{i}.attn_v.weight" in gg.tensors for i in computing if layer_types[i] == FULL
    ):
        raise UnsupportedError(
            f"{gg.path}: some global layers have attn_v and some do not; llmrun supports "
            "values from the keys in all of them or none"
        )
    return bool(missing)


def _local_rope(gg: GGUFFile, meta: ArchMetadata, head_dim: int) -> dict[str, Any]:
    turned = meta.get(Keys.Rope.DIMENSION_COUNT_SWA, head_dim)
    if turned != head_dim:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT_SWA.format(arch=ARCH)} is {turned}, but "
            f"the local heads are {head_dim} wide; Gemma 4 turns them whole"
        )
    return {"rope_type": "default", "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, ROPE_BASE_SWA)}


def _global_rope(gg: GGUFFile, meta: ArchMetadata, head_dim: int) -> dict[str, Any]:
    """The global layers' proportional RoPE from rope_freqs: its 1s turn, its 1e30s do
    not (a header-only read, `llmrun show`'s, leaves the share out: nothing it reports
    depends on it)."""
    scaling = meta.get(Keys.Rope.SCALING_TYPE, "none")
    if scaling not in ("none", None):
        raise UnsupportedError(f"{gg.path}: RoPE scaling {scaling!r} is not supported for Gemma 4")
    turned = meta.get(Keys.Rope.DIMENSION_COUNT, head_dim)
    if turned != head_dim:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is {turned}, but the "
            f"global heads are {head_dim} wide; the converter turns them whole, by rope_freqs"
        )
    rope = {"rope_type": "proportional", "rope_theta": meta.get(Keys.Rope.FREQ_BASE, 10000.0)}
    name = f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]}.weight"
    if name not in gg.tensors:
        raise ModelFormatError(f"{gg.path}: tensor {name!r} is missing; the global layers need it")
    if gg.buffer is None:
        return rope
    factors = read_float_list(gg, name)
    count = factors.count(1.0)
    share = 2 * count / head_dim
    # 1e30 as the file's f32 holds it; the share must give back the count (the model
    # takes int(share * head_dim // 2) frequencies, as transformers does).
    unturned = [math.isclose(f, UNTURNED, rel_tol=1e-6) for f in factors[count:]]
    if (
        len(factors) != head_dim // 2
        or factors[:count] != [1.0] * count
        or not all(unturned)
        or int(share * head_dim // 2) != count
    ):
        raise UnsupportedError(
            f"{gg.path}: {name} is not the converter's proportional RoPE (1 for each turning "
            f"frequency, then {UNTURNED:g}); llmrun supports no other"
        )
    rope["partial_rotary_factor"] = share
    return rope


def _experts(gg: GGUFFile, meta: ArchMetadata, layers: int) -> dict[str, Any]:
    """The MoE fields (enable_moe_block and the experts' sizes), where the file has experts."""
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    if not count:
        return {}
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=ARCH)} is {used}, but "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=ARCH)} is {count}"
        )
    gating = meta.get(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is not None and gating != ExpertGatingFuncType.SOFTMAX:
        raise UnsupportedError(
            f"{gg.path}: Gemma 4's experts are gated by softmax, but "
            f"{Keys.LLM.EXPERT_GATING_FUNC.format(arch=ARCH)} is {gating}"
        )
    for i in range(layers):
        if f"blk.{i}.ffn_gate_inp.weight" not in gg.tensors:
            raise UnsupportedError(
                f"{gg.path}: layer {i} has no router (ffn_gate_inp); llmrun supports Gemma 4 "
                "with experts in every layer"
            )
    width = _uniform(gg, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
                     meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))  # fmt: skip
    return {
        "enable_moe_block": True,
        "num_experts": count,
        "top_k_experts": used,
        "moe_intermediate_size": width,
    }


def _drop_unused_kv(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """`weights` without the sharing layers' key and value tensors."""
    text = config.get("text_config") or config
    layers = int(text["num_hidden_layers"])
    first = layers - int(text.get("num_kv_shared_layers") or 0)
    unused = tuple(f"model.layers.{i}.{n}" for i in range(first, layers) for n in _UNUSED_KV)
    return {name: w for name, w in weights.items() if not name.startswith(unused)}


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight: type) -> dict[str, Any]:
    """A Hugging Face folder's language-model weights (HF names) as the model has them:
    the stacked experts split into modules, the unused keys and values dropped; `weight`
    is the loader's Weight."""
    text = config.get("text_config") or config
    out = _drop_unused_kv(weights, config)
    if text.get("enable_moe_block"):
        hidden, width = text["hidden_size"], text["moe_intermediate_size"]
        out = experts.split_stacked(out, _STACKED_EXPERTS, hidden, width, weight)
    return out


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight: type) -> dict[str, Any]:
    """A GGUF's weights (HF names) as the model has them: the unused keys and values
    dropped, a layer_scalar of 1 where the file has none (llama.cpp's: no scaling)."""
    import torch

    out = _drop_unused_kv(weights, config)
    for i in range(config["num_hidden_layers"]):
        out.setdefault(f"model.layers.{i}.layer_scalar", weight(torch.ones(1)))
    return out


def cache_shapes(text: dict[str, Any]) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head width) in the KV cache of a Gemma 4 config, without
    torch, as llmrun.models.gemma4 shapes them: local layers head_dim and
    num_key_value_heads, global ones global_head_dim and (keys as values only)
    num_global_key_value_heads; per_layer_config's where the config has it. Layer types
    as transformers takes them (every sixth layer global by default, the last always)."""
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    dim = int(text.get("head_dim") or 256)
    kinds = text.get("layer_types") or [
        SLIDING if (i + 1) % GLOBAL_EVERY else FULL for i in range(layers)
    ]
    kinds = [*kinds[: layers - 1], FULL]
    per_layer = text.get("per_layer_config")
    if per_layer is not None:
        shapes = [(heads, dim)] * layers
        for index, overrides in per_layer.items():
            shapes[int(index)] = (
                int(overrides.get("num_key_value_heads", heads)),
                int(overrides.get("head_dim", dim)),
            )
        return shapes
    global_heads = heads
    if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
        global_heads = int(text["num_global_key_value_heads"])
    global_dim = int(text.get("global_head_dim") or GLOBAL_HEAD_DIM)
    return [(global_heads, global_dim) if k == FULL else (heads, dim) for k in kinds]
