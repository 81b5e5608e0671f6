"""MiMo-V2-Flash at the loader edge: Hub folders and llama.cpp's "mimo2" GGUFs, as the
config and tensor names of llmrun's mimo_v2_flash model.

Hub checkpoints name the sinks self_attn.attention_sink_bias (transformers renames
them), may fuse q, k and v into self_attn.qkv_proj (rows: queries, keys, values), hold
multi-token-prediction layers under model.mtp.*, which transformers ignores, and,
saved by transformers 5, stacked experts. Xiaomi's releases are FP8 (refused: a bf16
conversion or a GGUF runs).

GGUFs are read as llama.cpp's converter writes them (conversion/mimo.py MimoV2Model:
TextModel's keys, head_count_kv one per layer, the window, the per-layer window flags,
value_length, the experts' count and width, rope.dimension_count, the value scale,
nextn_predict_layers with the MTP layers last in block_count and in the per-layer
arrays; the sinks as attn_sinks, the experts stacked, the selection bias as
exp_probs_b.bias) and as src/models/mimo2.cpp reads them: the sliding layers' RoPE
base rope.freq_base_swa (10000 where absent), no value scale where absent, experts in
the layers that have a router (ffn_gate_inp), sigmoid scores renormalized and unscaled,
no grouped routing, sinks where a layer has them.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import experts, glm4_moe
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "mimo2", "mimo_v2_flash"
ROPE_BASE_SWA = 10000.0  # llama_hparams::rope_freq_base_train_swa where the file has none
# The gguf package installed may predate the key (llama.cpp's LLM_KV_ATTENTION_VALUE_SCALE).
VALUE_SCALE = getattr(Keys.Attention, "VALUE_SCALE", "{arch}.attention.value_scale")
_SINKS = TENSOR_NAMES[MODEL_TENSOR.ATTN_SINKS].split(".")[-1]
_QKV = TENSOR_NAMES[MODEL_TENSOR.ATTN_QKV].split(".")[-1]
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")
_HUB_SINKS = ".self_attn.attention_sink_bias"


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Any, weight_type: type
) -> dict[str, Any]:
    """A Hub folder's weights under llmrun's keys: sinks renamed, a fused qkv_proj split,
    stacked experts split, the multi-token-prediction layers left out; a quantized
    checkpoint (Xiaomi's FP8 release) refused."""
    from llmrun.models.mimo_v2_flash import ModelArgs

    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "?"
        raise UnsupportedError(
            f"{path}: {method} checkpoints are not supported; use a bf16 conversion or a GGUF"
        )
    args = ModelArgs.from_config(config)
    out = {}
    for name, w in weights.items():
        if name.startswith("model.mtp."):
            continue
        if name.endswith(_HUB_SINKS):
            name = name.removesuffix(_HUB_SINKS) + ".self_attn.sinks"
        if ".self_attn.qkv_proj." in name:
            layer = int(name.split(".")[2])
            out.update(_split_qkv(name, w.tensor, args, layer, weight_type))
            continue
        out[name] = w
    hidden, width = args.hidden_size, args.moe_intermediate_size
    return experts.split_stacked(out, _STACKED, hidden, width, weight_type)


def _split_qkv(name: str, tensor: Any, args: Any, layer: int, weight_type: type) -> dict:
    """A fused qkv_proj weight or bias [q + k + v rows, ...] as q_proj, k_proj, v_proj."""
    kv = args.layer_kv_heads(layer)
    rows = (
        args.num_attention_heads * args.head_dim,
        kv * args.head_dim,
        kv * args.v_head_dim,
    )
    if tensor.shape[0] != sum(rows):
        raise ModelFormatError(
            f"{name} has {tensor.shape[0]} rows, but the config implies {sum(rows)} "
            f"(queries {rows[0]}, keys {rows[1]}, values {rows[2]})"
        )
    out, start = {}, 0
    for part, count in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
        out[name.replace("qkv_proj", part)] = weight_type(tensor[start : start + count])
        start += count
    return out


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a mimo2 layer tensor (a stack of experts: a template with an
    `{expert}` field), or None where it is not one."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        layer, name, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
        if name == _SINKS and suffix == "weight":
            return f"{layer}.self_attn.sinks"
        if name == _QKV:
            return f"{layer}.self_attn.qkv_proj.{suffix}"  # split by gguf_weights
        if name == "ffn_norm":
            return f"{layer}.post_attention_layernorm.{suffix}"
    return glm4_moe.hf_name(gguf_name)


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The weights as the model takes them: a fused attn_qkv split into q, k and v (rows
    of blocks: a view each), a zero selection bias for the expert layers of a file
    without one (llama.cpp's exp_probs_b is optional: no bias then)."""
    import torch

    from llmrun.models.mimo_v2_flash import ModelArgs

    args = ModelArgs.from_config(config)
    out = {}
    for name, w in weights.items():
        if ".self_attn.qkv_proj." not in name:
            out[name] = w
            continue
        layer = int(name.split(".")[2])
        kv = args.layer_kv_heads(layer)
        rows = (
            args.num_attention_heads * args.head_dim,
            kv * args.head_dim,
            kv * args.v_head_dim,
        )
        if w.shape[0] != sum(rows):
            raise ModelFormatError(
                f"attn_qkv of layer {layer} has {w.shape[0]} rows, but the metadata implies "
                f"{sum(rows)} (queries {rows[0]}, keys {rows[1]}, values {rows[2]})"
            )
        start = 0
        for part, count in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
            shape = (count, *w.shape[1:])
            piece = w.tensor[start : start + count]
            out[name.replace("qkv_proj", part)] = weight_type(piece, w.ggml_type, shape)
            start += count
    for layer, kind in enumerate(args.mlp_layer_types):
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if kind == "sparse" and bias not in out:
            out[bias] = weight_type(torch.zeros(args.n_routed_experts))
    return out


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """MiMo-V2-Flash's fields of the HF-style config that config_from_gguf built, as
    llama_model_mimo2::load_arch_hparams and load_arch_tensors read them. Refuses what
    llama.cpp would run otherwise than transformers: sliding layers without sinks or
    global ones with them, sliding layers with other than twice the global layers'
    key/value heads, grouped routing, RoPE scaling, per-layer query head counts."""
    path = gg.path
    layers, nextn = glm4_moe.trunk_layers(gg, ARCH)
    config.update(num_hidden_layers=layers)
    config[glm4_moe.NEXTN] = nextn

    def trunk(value: Any) -> Any:
        # Per-layer arrays hold the MTP layers too: the trunk's come first.
        return value[:layers] if isinstance(value, list) and len(value) >= layers else value

    flags = trunk(meta.require(Keys.Attention.SLIDING_WINDOW_PATTERN))
    if not isinstance(flags, list) or len(flags) != layers:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Attention.SLIDING_WINDOW_PATTERN)} is {flags!r}, not a flag "
            f"for each of the {layers} layers"
        )
    layer_types = ["sliding_attention" if f else "full_attention" for f in flags]
    if isinstance(config["num_attention_heads"], list):
        raise UnsupportedError(f"{path}: query head counts per layer are not supported")
    kv = trunk(config["num_key_value_heads"])
    kv = kv if isinstance(kv, list) else [kv] * layers
    global_kv = {h for h, t in zip(kv, layer_types, strict=True) if t == "full_attention"}
    local_kv = {h for h, t in zip(kv, layer_types, strict=True) if t == "sliding_attention"}
    if (
        len(global_kv) > 1
        or len(local_kv) > 1
        or (global_kv and local_kv and local_kv != {2 * h for h in global_kv})
    ):
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.Attention.HEAD_COUNT_KV)} is {kv}; MiMo-V2-Flash's sliding "
            "layers have twice the key/value heads of its global layers"
        )
    for layer, kind in enumerate(layer_types):
        if (f"blk.{layer}.{_SINKS}.weight" in gg.tensors) != (kind == "sliding_attention"):
            raise UnsupportedError(
                f"{path}: layer {layer} ({kind}) {'has' if kind == 'full_attention' else 'lacks'} "
                "attention sinks; MiMo-V2-Flash has them in its sliding layers alone"
            )
    groups = meta.get(Keys.LLM.EXPERT_GROUP_COUNT, 1)
    if groups > 1 and meta.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, groups) < groups:
        raise UnsupportedError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_GROUP_COUNT)} is {groups} with fewer groups used; "
            "llama.cpp's mimo2 ignores the groups, transformers chooses among them, and "
            "llmrun does not guess which the model was trained with"
        )
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.LLM.EXPERT_USED_COUNT)} is {used}, but "
            f"{meta.name(Keys.LLM.EXPERT_COUNT)} is {count} (each token needs 1 to {count} experts)"
        )
    width = trunk(meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    if isinstance(width, list):  # llama.cpp's get_key_or_arr: one per layer
        if len(set(width)) != 1:
            raise UnsupportedError(
                f"{path}: {meta.name(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} differs between "
                "layers, which llmrun does not support"
            )
        width = width[0]
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default":
        raise UnsupportedError(
            f"{path}: RoPE scaling {rope['rope_type']!r} in a mimo2 file is not supported"
        )
    # Stated for both layer types: the model's default share (0.334) is transformers'.
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT) or config["head_dim"]
    if rotated % 2 or rotated > config["head_dim"]:
        raise ModelFormatError(
            f"{path}: {meta.name(Keys.Rope.DIMENSION_COUNT)} is {rotated}, but RoPE rotates pairs "
            f"of the {config['head_dim']} features of a head"
        )
    rope["partial_rotary_factor"] = rotated / config["head_dim"]
    local = {**rope, "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, ROPE_BASE_SWA)}
    config.update(
        layer_types=layer_types,
        num_key_value_heads=min(kv),
        v_head_dim=meta.get(Keys.Attention.VALUE_LENGTH, config["head_dim"]),
        sliding_window=meta.require(Keys.Attention.SLIDING_WINDOW),
        mlp_layer_types=[
            "sparse" if f"blk.{i}.ffn_gate_inp.weight" in gg.tensors else "dense"
            for i in range(layers)
        ],
        n_routed_experts=count,
        num_experts_per_tok=used,
        moe_intermediate_size=width,
        routed_scaling_factor=1.0,  # mimo2.cpp reads no scale
        norm_topk_prob=True,  # and always renormalizes
        n_group=1,
        topk_group=1,
        # No key (or 1): llama.cpp leaves the values unscaled.
        attention_value_scale=meta.get(VALUE_SCALE, 1.0),
        attention_bias=config["attention_bias"] or "blk.0.attn_qkv.bias" in gg.tensors,
        rope_parameters={"full_attention": rope, "sliding_attention": local},
        hidden_act="silu",
    )


def cache_layout(text: dict[str, Any]) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Each layer's cached (key/value heads, head width) and window (None: global) for a
    mimo_v2_flash config, as llmrun.models.mimo_v2_flash caches it (ModelArgs.cache_shapes,
    layer_windows): the sliding layers with twice the global layers' heads, values padded
    to head_dim. Torch-free, for `llmrun show`."""
    layers = int(text["num_hidden_layers"])
    kinds = text.get("layer_types")
    if kinds is None and text.get("hybrid_layer_pattern") is not None:
        kinds = [
            "sliding_attention" if p else "full_attention" for p in text["hybrid_layer_pattern"]
        ]
    if kinds is None:
        kinds = [
            "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if text.get("sliding_window_size") is not None:
        window = int(text["sliding_window_size"]) + 1
    else:
        window = int(text.get("sliding_window") or 129)
    kv, head_dim = int(text.get("num_key_value_heads") or 4), int(text.get("head_dim") or 192)
    sliding = [kind == "sliding_attention" for kind in kinds]
    shapes = [(kv * 2 if s else kv, head_dim) for s in sliding]
    return shapes, [window if s else None for s in sliding]
