"""DeepSeek-V4 at the loader edge: GGUFs of llama.cpp's arch "deepseek4" as its converter
writes them (conversion/deepseek.py DeepseekV4Model) and llama.cpp reads them
(src/models/deepseek4.cpp load_arch_hparams), and transformers' checkpoints, as the
config and tensors of llmrun's deepseek_v4 model.

The converter writes each tensor as the checkpoint holds it (no permutation: RoPE turns
adjacent pairs of each head's last features there as here), renamed; the experts in
stacks (MXFP4 from the Hub's FP4 experts), the hash layers' token -> experts tables as
I32 (blk.N.ffn_gate_tid2eid, [vocab, experts used]), the FP8 attention matrices as Q8_0.
Per layer, attention.compress_ratios says the kind: 0 sliding, 4 compressed-sparse (with
the indexer, overlapping windows), 128 heavily-compressed; llama.cpp accepts no other.
The file's RoPE scaling (YaRN) applies to the compressed layers alone, at
attention.compress_rope_freq_base, without YaRN's attention factor (llama.cpp divides
it back out); the sliding layers turn at rope.freq_base. Experts must be
sqrt(softplus)-gated (llama.cpp refuses anything else); a file that does not
renormalize the chosen experts' weights is refused (transformers always does).

GGUF keys gguf 0.19 has no constants for are spelled as llama.cpp's constants.py spells
them. A vision variant's exp_probs_b_vl (the image tokens' routing bias) is not used: a
text model's tokens take exp_probs_b.
"""

from __future__ import annotations

import re
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import deepseek2, experts
from llmrun.loading.gguf_io import ArchMetadata

ARCH = "deepseek4"
MODEL_TYPE = "deepseek_v4"
SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
# gguf 0.19 lacks these keys (llama.cpp's gguf-py/gguf/constants.py spells them so).
OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"
COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
HC_COUNT = "{arch}.hyper_connection.count"
HC_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
HC_EPSILON = "{arch}.hyper_connection.epsilon"
HASH_LAYER_COUNT = "{arch}.hash_layer_count"
SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"
SWIGLU_CLAMP_SHEXP = "{arch}.swiglu_clamp_shexp"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
KIND_OF_RATIO = {0: "sliding_attention", 4: CSA}
HCA_RATIO = 128
# The vision variant's routing bias for image tokens: read, then left out (see above).
UNUSED = "unused.exp_probs_b_vl"

_ROOT = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}
# blk.N.<name> (with its .weight/.bias) -> the key under model.layers.N.
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv.weight": "self_attn.kv_proj.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
    "attn_output_a.weight": "self_attn.o_a_proj.weight",
    "attn_output_b.weight": "self_attn.o_b_proj.weight",
    "attn_compressor_kv.weight": "self_attn.compressor.kv_proj.weight",
    "attn_compressor_gate.weight": "self_attn.compressor.gate_proj.weight",
    "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
    "attn_compressor_norm.weight": "self_attn.compressor.kv_norm.weight",
    "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "indexer_compressor_kv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "indexer_compressor_gate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
    "indexer_compressor_norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
for _stream in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        _LAYER[f"hc_{_stream}_{_part}.weight"] = f"{_stream}_hc.{_part}"
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# transformers 5's stacked experts of a layer (llmrun.loading.experts).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a deepseek4 GGUF tensor, or None if it has none."""
    if gguf_name in _ROOT:
        return _ROOT[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None:
        return None
    if match.group(2) == "exp_probs_b_vl.bias":
        return f"{UNUSED}.{match.group(1)}"
    name = _LAYER.get(match.group(2))
    return None if name is None else f"model.layers.{match.group(1)}.{name}"


def config_from_gguf(gg, rope_from_gguf) -> dict[str, Any]:
    """An HF-style deepseek_v4 config from the file's metadata, read as llama.cpp reads
    it (every key it requires is required here)."""
    path, arch = gg.path, gg.architecture
    meta = ArchMetadata.of(gg)
    gating = meta.require(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != SQRT_SOFTPLUS:
        raise UnsupportedError(
            f"{path}: {Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)} is {gating}; "
            f"DeepSeek-V4's experts are sqrt(softplus)-gated ({SQRT_SOFTPLUS}), as llama.cpp requires"
        )
    if not meta.require(Keys.LLM.EXPERT_WEIGHTS_NORM):
        raise UnsupportedError(
            f"{path}: {Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch)} is false; llmrun's "
            "DeepSeek-V4 renormalizes the chosen experts' weights, as transformers does"
        )
    nextn = meta.get(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    layers = meta.require(Keys.LLM.BLOCK_COUNT) - nextn
    hidden, heads = meta.require(Keys.LLM.EMBEDDING_LENGTH), meta.require(Keys.Attention.HEAD_COUNT)
    head_dim = meta.get(Keys.Attention.KEY_LENGTH, hidden // heads)
    ratios = meta.require(COMPRESS_RATIOS)
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise ModelFormatError(
            f"{path}: {COMPRESS_RATIOS.format(arch=arch)} is {ratios!r}, not one ratio per "
            f"layer of {layers}"
        )
    unknown = sorted(set(ratios[:layers]) - {0, 4, HCA_RATIO})
    if unknown:
        raise UnsupportedError(
            f"{path}: compression ratios {unknown} are not supported (0, 4 and 128 are, as in "
            "llama.cpp)"
        )
    layer_types = [KIND_OF_RATIO.get(r, HCA) for r in ratios[:layers]]
    experts_used = meta.require(Keys.LLM.EXPERT_USED_COUNT)
    limits = _per_layer(
        meta.require(SWIGLU_CLAMP_EXP), layers, path, SWIGLU_CLAMP_EXP.format(arch=arch)
    )
    shared = meta.get(SWIGLU_CLAMP_SHEXP, limits)
    if _per_layer(shared, layers, path, SWIGLU_CLAMP_SHEXP.format(arch=arch)) != limits:
        raise UnsupportedError(f"{path}: routed and shared experts clamped differently")
    if len(set(limits)) > 1:
        raise UnsupportedError(f"{path}: SwiGLU clamps that differ by layer are not supported")
    hashed = meta.require(HASH_LAYER_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)

    rope = rope_from_gguf(gg, meta, head_dim, context)
    factor = rope.get("partial_rotary_factor", 1.0)
    main = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    compress = {**rope, "rope_theta": meta.require(COMPRESS_ROPE_FREQ_BASE)}
    if compress["rope_type"] == "yarn":
        compress["attention_factor"] = 1.0  # llama.cpp's dsv4_rope_attn_factor undoes it
    for params in (main, compress):
        params["partial_rotary_factor"] = factor
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    return {
        "model_type": MODEL_TYPE,
        "vocab_size": len(tokens) if tokens else embed.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, 1),
        "head_dim": head_dim,
        "q_lora_rank": meta.require(Keys.Attention.Q_LORA_RANK),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "sliding_window": meta.require(Keys.Attention.SLIDING_WINDOW),
        "moe_intermediate_size": meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "n_routed_experts": meta.require(Keys.LLM.EXPERT_COUNT),
        "num_experts_per_tok": experts_used,
        "n_shared_experts": meta.require(Keys.LLM.EXPERT_SHARED_COUNT),
        "routed_scaling_factor": meta.require(Keys.LLM.EXPERT_WEIGHTS_SCALE),
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": limits[0],
        "index_n_heads": meta.require(Keys.Attention.Indexer.HEAD_COUNT),
        "index_head_dim": meta.require(Keys.Attention.Indexer.KEY_LENGTH),
        "index_topk": meta.require(Keys.Attention.Indexer.TOP_K),
        "o_groups": meta.require(OUTPUT_GROUP_COUNT),
        "o_lora_rank": meta.require(OUTPUT_LORA_RANK),
        "layer_types": layer_types,
        "compress_rates": {CSA: 4, HCA: HCA_RATIO},
        "hc_mult": meta.require(HC_COUNT),
        "hc_sinkhorn_iters": meta.require(HC_SINKHORN_ITERATIONS),
        "hc_eps": meta.require(HC_EPSILON),
        "mlp_layer_types": ["hash_moe"] * min(hashed, layers) + ["moe"] * max(0, layers - hashed),
        "partial_rotary_factor": factor,
        "rope_parameters": {"main": main, "compress": compress},
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "num_nextn_predict_layers": nextn,
    }


def _per_layer(value: Any, layers: int, path: Any, name: str) -> list[float]:
    """A key llama.cpp reads with get_key_or_arr: one value for every layer, or a list."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) < layers:
        raise ModelFormatError(f"{path}: {name} has {len(values)} entries for {layers} layers")
    return [float(v) for v in values[:layers]]


def cache_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head width) in llmrun's deepseek_v4 cache, without torch
    (for `llmrun show`; the twin of deepseek_v4.ModelArgs.cache_shapes): one row a token,
    padded to blocks of 32, of the key (head_dim) for a sliding layer; also the
    compressor's kv and gate projections and an entry for a heavily-compressed one (4
    head_dim); two series of each, and its indexer's, for a compressed-sparse one (6
    head_dim + 5 index_head_dim). Layer kinds as transformers derives them."""
    layers = int(config["num_hidden_layers"])
    hd = int(config.get("head_dim") or 512)
    ih = int(config.get("index_head_dim") or 128)
    kinds = config.get("layer_types")
    if kinds is None and config.get("compress_ratios") is not None:
        kinds = [KIND_OF_RATIO.get(r, HCA) for r in config["compress_ratios"]]
    if kinds is None:  # 2 heavily-compressed layers, then compressed-sparse ones in turn
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    widths = {"sliding_attention": hd, HCA: 4 * hd, CSA: 6 * hd + 5 * ih}
    return [(1, -(-widths.get(kind, hd) // 32) * 32) for kind in kinds[:layers]]


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """The grouped output projections (o_a_proj, not a Linear) in floats where the file
    has blocks, the image-token routing bias left out."""
    out = {}
    for name, w in weights.items():
        if name.startswith(UNUSED):
            continue
        if name.endswith("o_a_proj.weight") and w.ggml_type is not None:
            w = weight_type(deepseek2._floats(w).reshape(w.shape))
        out[name] = w
    return out


# DeepSeek's checkpoint names (which transformers also saves, the Hub release's without
# "model.") -> transformers' module names, which llmrun's model has: the root tensors,
# then per layer (after layers.N.).
_HUB_ROOT = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_HUB_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
for _stream in ("attn", "ffn"):
    for _part in ("fn", "base", "scale"):
        _HUB_LAYER[f"hc_{_stream}_{_part}"] = f"{_stream}_hc.{_part}"
for _hub, _ours in (("attn.compressor", "self_attn.compressor"),
                    ("attn.indexer.compressor", "self_attn.compressor.indexer")):  # fmt: skip
    for _name, _module in (("wkv.weight", "kv_proj.weight"), ("wgate.weight", "gate_proj.weight"),
                           ("ape", "position_bias"), ("norm.weight", "kv_norm.weight")):  # fmt: skip
        _HUB_LAYER[f"{_hub}.{_name}"] = f"{_ours}.{_module}"
_HUB_EXPERT = re.compile(r"ffn\.(experts\.\d+|shared_experts)\.(w[123])\.weight")
_HUB_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HUB_BLOCK = re.compile(r"(?:model\.)?layers\.(\d+)\.(.+)")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Any, weight_type: type
) -> dict[str, Any]:
    """A checkpoint in DeepSeek's names (the Hub's, and what transformers saves) or in
    transformers' module names (stacked experts split per expert), as the model's keys;
    the multi-token-prediction layer (mtp.*) and the hash layers' unused gate.bias left
    out, as transformers leaves them. The Hub's release itself, FP8 and FP4, is refused."""
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "?"
        raise UnsupportedError(
            f"{path}: DeepSeek-V4's {method} checkpoints (FP8 attention, FP4 experts) are not "
            "supported; convert it to GGUF with llama.cpp's convert_hf_to_gguf.py, or use a "
            "bf16 conversion"
        )
    hashed = {i for i, kind in enumerate(_mlp_layer_types(config)) if kind == "hash_moe"}
    out = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue
        key = _hub_key(name.removeprefix("model."))
        if key is None:
            out[name] = w
            continue
        match = _HUB_BLOCK.fullmatch(name)
        if match and int(match.group(1)) in hashed and match.group(2) == "ffn.gate.bias":
            continue
        out[key] = w
    width = config.get("moe_intermediate_size", 2048)
    return experts.split_stacked(out, _STACKED, config["hidden_size"], width, weight_type)


def _hub_key(name: str) -> str | None:
    """The model's key for a tensor in DeepSeek's names (without a "model." prefix), or
    None where it is not one of them."""
    if name in _HUB_ROOT:
        return _HUB_ROOT[name]
    match = _HUB_BLOCK.fullmatch(name)
    if match is None:
        return None
    layer, rest = match.groups()
    expert = _HUB_EXPERT.fullmatch(rest)
    if expert is not None:
        return (
            f"model.layers.{layer}.mlp.{expert.group(1)}.{_HUB_PROJECTIONS[expert.group(2)]}.weight"
        )
    ours = _HUB_LAYER.get(rest)
    return None if ours is None else f"model.layers.{layer}.{ours}"


def _mlp_layer_types(config: dict[str, Any]) -> list[str]:
    from llmrun.models.deepseek_v4 import ModelArgs

    return ModelArgs.from_config(config).mlp_layer_types
