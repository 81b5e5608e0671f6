"""LFM2 and LFM2-MoE GGUFs (arch "lfm2", "lfm2moe") as llama.cpp's converter writes
them (conversion/lfm2.py LFM2Model, LFM2MoeModel), read as src/models/lfm2.cpp and
lfm2moe.cpp read them.

The converter writes head_count_kv per layer, 0 for a convolution layer (llama.cpp's
is_recr), so the layer pattern comes from it; feed_forward_length is LFM2's width after
its auto-adjustment (block_auto_adjust_ff_dim, done), the experts' width is
expert_feed_forward_length; the convolution kernels [hidden, 1, L] lose their middle
axis ([hidden, L]); embedding_norm, the final norm, is token_embd_norm; the experts are
stacked; expert_bias is exp_probs_b.bias. llama.cpp gates LFM2-MoE's experts by the
sigmoid (the file says so), always renormalizes the chosen weights and never scales
them; its first leading_dense_block_count layers (default 0) are dense.

LFM2's embedding variants (bidirectional attention, pooling, the dense_2 projection of
LFM2-ColBERT) and the audio tokenizer's sliding window are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, layer_name, vocab_size

if TYPE_CHECKING:  # gguf_io imports inspect, which reads attention_layer_count here
    from llmrun.loading.gguf_io import GGUFFile

ARCH, MOE_ARCH = "lfm2", "lfm2moe"
MODEL_TYPES = {ARCH: "lfm2", MOE_ARCH: "lfm2_moe"}


# GGUF tensor (after "blk.N.") -> HF module (after "model.layers.N.").
LAYER_NAMES = {
    layer_name(MODEL_TENSOR.ATTN_NORM): "operator_norm",
    layer_name(MODEL_TENSOR.FFN_NORM): "ffn_norm",
    layer_name(MODEL_TENSOR.ATTN_Q): "self_attn.q_proj",
    layer_name(MODEL_TENSOR.ATTN_K): "self_attn.k_proj",
    layer_name(MODEL_TENSOR.ATTN_V): "self_attn.v_proj",
    layer_name(MODEL_TENSOR.ATTN_OUT): "self_attn.out_proj",
    layer_name(MODEL_TENSOR.ATTN_Q_NORM): "self_attn.q_layernorm",
    layer_name(MODEL_TENSOR.ATTN_K_NORM): "self_attn.k_layernorm",
    layer_name(MODEL_TENSOR.SHORTCONV_CONV): "conv.conv",
    layer_name(MODEL_TENSOR.SHORTCONV_INPROJ): "conv.in_proj",
    layer_name(MODEL_TENSOR.SHORTCONV_OUTPROJ): "conv.out_proj",
    layer_name(MODEL_TENSOR.FFN_GATE): "feed_forward.w1",
    layer_name(MODEL_TENSOR.FFN_UP): "feed_forward.w3",
    layer_name(MODEL_TENSOR.FFN_DOWN): "feed_forward.w2",
    layer_name(MODEL_TENSOR.FFN_GATE_INP): "feed_forward.gate",
    # The converter renames the expert_bias buffer to expert_bias.bias, so ".bias" ends it.
    layer_name(MODEL_TENSOR.FFN_EXP_PROBS_B): "feed_forward.expert_bias",
    # Each expert's key, with an {expert} field: the loader splits the stacks.
    layer_name(MODEL_TENSOR.FFN_GATE_EXP): "feed_forward.experts.{expert}.w1",
    layer_name(MODEL_TENSOR.FFN_UP_EXP): "feed_forward.experts.{expert}.w3",
    layer_name(MODEL_TENSOR.FFN_DOWN_EXP): "feed_forward.experts.{expert}.w2",
}
GLOBAL_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "model.embed_tokens",
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD_NORM]: "model.embedding_norm",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
}
_EMBEDDING_OUT = TENSOR_NAMES[MODEL_TENSOR.DENSE_2_OUT] + ".weight"  # LFM2-ColBERT's


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face key of an LFM2 GGUF tensor, or None if it has none."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".", 2)
    if (
        len(parts) != 3
        or parts[0] != "blk"
        or not parts[1].isdigit()
        or parts[2] not in LAYER_NAMES
    ):
        return None
    name = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    if parts[2] == layer_name(MODEL_TENSOR.FFN_EXP_PROBS_B):
        return name if suffix == "bias" else None
    return f"{name}.{suffix}"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The HF-style config (lfm2 or lfm2_moe) of an LFM2 GGUF; rope_from_gguf is
    gguf_config's RoPE reader."""
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    _refuse_variants(gg, meta)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = _one_value(gg, meta, Keys.Attention.HEAD_COUNT, layers, required=True)
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    kv_list = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(kv_list) != layers:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=arch)} lists "
            f"{len(kv_list)} layers, but the model has {layers}"
        )
    attending = {n for n in kv_list if n}
    if len(attending) != 1:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Attention.HEAD_COUNT_KV.format(arch=arch)} is {kv_heads}; llmrun "
            "runs LFM2 with attention layers that all have the same number of key/value heads"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "block_auto_adjust_ff_dim": False,  # the file's width is the adjusted one
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": attending.pop(),
        "head_dim": head_dim,
        "layer_types": ["full_attention" if n else "conv" for n in kv_list],
        "norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "conv_L_cache": meta.require(Keys.ShortConv.L_CACHE),
        "max_position_embeddings": meta.require(Keys.LLM.CONTEXT_LENGTH),
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in gg.tensors,
    }
    rope = rope_from_gguf(gg, meta, head_dim, config["max_position_embeddings"])
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is not the head size "
            f"{head_dim}; LFM2 rotates whole heads"
        )
    config["rope_parameters"] = rope
    if arch == MOE_ARCH:
        config.update(_experts(gg, meta, layers))
    return config


def _experts(gg: GGUFFile, meta: ArchMetadata, layers: int) -> dict[str, Any]:
    """LFM2-MoE's expert fields, read as llama_model_lfm2moe::load_arch_hparams does."""
    arch = gg.architecture
    count = meta.get(Keys.LLM.EXPERT_COUNT, 0)
    used = meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{gg.path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)} is {used}, but "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=arch)} is {count} (each token needs 1 to "
            f"{count} experts)"
        )
    gating = meta.require(Keys.LLM.EXPERT_GATING_FUNC)
    if gating != ExpertGatingFuncType.SIGMOID:
        known = {int(t): t.name.lower() for t in ExpertGatingFuncType}
        raise UnsupportedError(
            f"{gg.path}: {Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch)} is "
            f"{known.get(gating, f'{gating} (unknown)')}; LFM2-MoE's experts are gated by "
            "the sigmoid, the only gating llmrun runs it with"
        )
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": _one_value(
            gg, meta, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, layers, required=True
        ),
        "num_dense_layers": meta.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "use_expert_bias": True,  # llama.cpp requires exp_probs_b in every expert layer
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    }


def _refuse_variants(gg: GGUFFile, meta: ArchMetadata) -> None:
    """Refuse what llmrun's LFM2 does not compute: the embedding models' bidirectional
    attention and pooled or projected outputs, and sliding-window attention."""
    arch = gg.architecture
    if (
        meta.get(Keys.Attention.CAUSAL, True) is False
        or meta.get(Keys.LLM.POOLING_TYPE)
        or _EMBEDDING_OUT in gg.tensors
    ):
        raise UnsupportedError(
            f"{gg.path}: an LFM2 embedding model (bidirectional attention, pooling or a dense "
            "output projection, as LFM2-ColBERT and LFM2.5-Embedding) is not supported; "
            "llmrun runs LFM2's causal language models"
        )
    if meta.get(Keys.Attention.SLIDING_WINDOW, 0):
        raise UnsupportedError(
            f"{gg.path}: {Keys.Attention.SLIDING_WINDOW.format(arch=arch)} is set; LFM2 with "
            "sliding-window attention (LFM2.5-Audio's tokenizer) is not supported"
        )


def _one_value(gg: GGUFFile, meta: ArchMetadata, template: str, layers: int, required: bool) -> Any:
    """A key llama.cpp reads as one value or one per layer (get_key_or_arr), where llmrun
    needs a single value: refused when the layers differ."""
    value = meta.require(template) if required else meta.get(template)
    if isinstance(value, list):
        if len(value) != layers or len(set(value)) != 1:
            raise UnsupportedError(
                f"{gg.path}: {template.format(arch=gg.architecture)} is {value}; llmrun "
                "runs LFM2 with one value for every layer"
            )
        value = value[0]
    return value


def gguf_weights(weights: dict[str, Any], weight: type) -> dict[str, Any]:
    """The convolution kernels back in the HF shape [hidden, 1, L] (the converter
    squeezes out the middle axis); `weight` is the loader's Weight."""
    out = {}
    for name, w in weights.items():
        if name.endswith("conv.conv.weight"):
            if w.ggml_type is not None:
                raise ModelFormatError(
                    f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp's converter "
                    "keeps LFM2's convolution kernels in float"
                )
            w = weight(w.tensor.unsqueeze(1), None, (w.shape[0], 1, w.shape[1]))
        out[name] = w
    return out


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many of an lfm2/lfm2_moe config's layers attend (and so have a KV cache), as
    the model reads layer_types or full_attn_idxs; None for another config."""
    if config.get("model_type") not in MODEL_TYPES.values():
        return None
    kinds = config.get("layer_types")
    if kinds is not None:
        return sum(kind == "full_attention" for kind in kinds)
    attending = config.get("full_attn_idxs")
    return len(attending) if attending is not None else int(config["num_hidden_layers"])
