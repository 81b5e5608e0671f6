"""OLMo 2 and OLMo 3 at the loader edge: llama.cpp writes both as arch "olmo2"
(conversion/olmo.py), OLMo 3 with a sliding window and a per-layer pattern, and reads
them as src/models/olmo2.cpp does: NEOX RoPE on unpermuted q/k, the window's layers
(load_swa_pattern(ml, 4) where the file lists none) rotated with the global base and
no scaling, the global layers with the file's scaling. The first OLMo is arch "olmo"
(olmo1_config_from_gguf below): q/k permuted as for arch llama, no norm tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = "olmo2"
MODEL_TYPES = ("olmo2", "olmo3")
SWA_PATTERN = 4  # llama_model_olmo2::load_arch_hparams: load_swa_pattern(ml, 4)
# The post-sublayer norms (OLMo 2 has no pre-norms), GGUF name -> HF module.
LAYER_NAMES = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_POST_NORM].split(".")[-1]: "post_attention_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.FFN_POST_NORM].split(".")[-1]: "post_feedforward_layernorm",
}


def config_from_gguf(
    gg: GGUFFile,
    config: dict[str, Any],
    meta: ArchMetadata,
    rope_from_gguf: Callable[..., dict[str, Any]],
    layer_types: Callable[..., list[str]],
) -> dict[str, Any]:
    """OLMo 2's (no window) or OLMo 3's (a window) config from an "olmo2" GGUF. `config`
    holds the common fields; rope_from_gguf and layer_types are gguf_config's readers of
    the RoPE keys and of llama.cpp's window pattern."""
    head_dim = config["head_dim"]
    rope = rope_from_gguf(gg, meta, head_dim, config["max_position_embeddings"])
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{head_dim}; OLMo rotates whole heads"
        )
    window = meta.get(Keys.Attention.SLIDING_WINDOW) or None
    if window is None:
        config.update(model_type="olmo2", rope_parameters=rope)
        return config
    local_base = meta.get(Keys.Rope.FREQ_BASE_SWA)
    if local_base is not None and local_base != rope["rope_theta"]:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH)} ({local_base}) differs "
            f"from {Keys.Rope.FREQ_BASE.format(arch=ARCH)} ({rope['rope_theta']}); llama.cpp "
            "rotates OLMo 3's sliding layers with the global base, and llmrun does not guess "
            "which one the model was trained with"
        )
    local = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    config.update(
        model_type="olmo3",
        sliding_window=window,
        layer_types=layer_types(gg, meta, config["num_hidden_layers"], SWA_PATTERN),
        rope_parameters={"full_attention": rope, "sliding_attention": local},
    )
    return config


# OLMo (the first): llama.cpp's arch "olmo" (conversion/olmo.py OlmoModel), a model of
# its own in llmrun (llmrun/models/olmo.py), not OLMo 2's.
OLMO1_ARCH = OLMO1_MODEL_TYPE = "olmo"
OLMO1_NORM_EPS = 1e-5  # the converter's; OlmoLayerNorm's, which no config changes


def olmo1_config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """OLMo's HF-style config (OlmoConfig's fields) from an "olmo" GGUF, as llama.cpp's
    converter writes it (TextModel's keys, the LayerNorm epsilon 1e-5, clip_qkv as
    attention.clamp_kqv; q/k rows permuted as for arch llama, which the loader undoes)
    and src/models/olmo.cpp reads it: no norm tensors, the projections clamped where
    clamp_kqv is over 0, RoPE on whole heads, the output matrix or else the embedding.
    rope_from_gguf is gguf_config's reader of the RoPE keys."""
    arch = OLMO1_ARCH
    meta = ArchMetadata.of(gg, arch)
    for info in gg.tensors.values():
        # The converter permutes q/k weights but not biases, and llama.cpp's olmo loads
        # no output bias: a file with biases is one llama.cpp does not run either.
        if info.name.endswith(".bias") or ".attn_qkv." in info.name:
            raise UnsupportedError(
                f"{gg.path}: tensor {info.name!r}: an OLMo GGUF with attention biases or a "
                "fused attn_qkv is not supported (llama.cpp's converter writes neither)"
            )
    eps = meta.require(Keys.Attention.LAYERNORM_EPS)
    if abs(eps - OLMO1_NORM_EPS) > 1e-9:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Attention.LAYERNORM_EPS.format(arch=arch)} is {eps}; OLMo's "
            f"LayerNorms have an epsilon of {OLMO1_NORM_EPS}, the only one llmrun's OLMo has"
        )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        raise ModelFormatError(
            f"{gg.path}: an embedding length of {hidden!r} and a head count of {heads!r} "
            "are not positive whole numbers"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{gg.path}: OLMo's keys and values of different lengths")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise ModelFormatError(
            f"{gg.path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} is not the head size "
            f"{head_dim}; OLMo rotates whole heads"
        )
    clamp = meta.get(Keys.Attention.CLAMP_KQV, 0.0)
    return {
        "model_type": OLMO1_MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "clip_qkv": clamp if clamp > 0 else None,  # llama.cpp clamps where it is over 0
        "rope_parameters": rope,
    }
