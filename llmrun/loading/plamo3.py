"""PLaMo 3 at the loader edge: the Hub's folders (Plamo3ForCausalLM), and "plamo3" GGUFs as
llama.cpp's converter writes them (conversion/plamo.py Plamo3Model) and llama.cpp reads
them (src/models/plamo3.cpp).

As PLaMo 2's (llmrun/loading/plamo2.py): the folders' "model.layers.layers.N." is
llmrun's "model.layers.N.", and the converter adds each norm's offset to its weight (the
q and k norms' 1 too), undone here. The window is attention.sliding_window, the global
layers by attention.sliding_window_pattern (load_swa_pattern(8)), the sliding layers'
RoPE base rope.freq_base_swa (the global one where absent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import plamo2
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, layer_name, mapped_name, vocab_size

ARCH = MODEL_TYPE = "plamo3"
SWA_PATTERN = 8  # llama.cpp's load_swa_pattern(ml, 8)

_ATTENTION_NORMS = {
    layer_name(MODEL_TENSOR.ATTN_Q_NORM) + ".weight": "mixer.q_norm.weight",
    layer_name(MODEL_TENSOR.ATTN_K_NORM) + ".weight": "mixer.k_norm.weight",
}
LAYER_NAMES = {
    **{k: v for k, v in plamo2.LAYER_NAMES.items() if not v.startswith("mixer.")},
    layer_name(MODEL_TENSOR.ATTN_QKV) + ".weight": "mixer.qkv_proj.weight",
    layer_name(MODEL_TENSOR.ATTN_OUT) + ".weight": "mixer.o_proj.weight",
    **_ATTENTION_NORMS,
}
OFFSETS = {**plamo2.OFFSETS, **dict.fromkeys(_ATTENTION_NORMS.values(), 1.0)}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key of a plamo3 GGUF tensor, or None if it is not one."""
    return mapped_name(gguf_name, plamo2.GLOBAL_NAMES, LAYER_NAMES, "model.layers.")


def config_from_gguf(
    gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]], layer_types: Callable[..., Any]
) -> dict[str, Any]:
    """The config.json-style dict of a plamo3 GGUF, as llama_model_plamo3::load_arch_hparams
    reads it. `rope_from_gguf` and `layer_types`: gguf_config's readers of the RoPE keys and
    of load_swa_pattern's layer flags."""
    meta = ArchMetadata.of(gg, ARCH)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    feed_forward = meta.require(Keys.LLM.FEED_FORWARD_LENGTH)
    if not all(isinstance(v, int) for v in (heads, kv_heads, feed_forward)) or heads <= 0:
        raise UnsupportedError(
            f"{gg.path}: PLaMo 3 with head counts or feed-forward widths per layer is not supported"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise ModelFormatError(f"{gg.path}: PLaMo 3 keys and values of different widths")
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    window = meta.get(Keys.Attention.SLIDING_WINDOW) or None
    rope = rope_from_gguf(gg, meta, head_dim, context)
    local_rope = {**rope, "rope_theta": meta.get(Keys.Rope.FREQ_BASE_SWA, rope["rope_theta"])}
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": feed_forward,
        "vocab_size": vocab_size(gg, meta),
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "sliding_window": window,
        "layer_types": layer_types(gg, meta, layers, SWA_PATTERN if window else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "rope_parameters": rope,
        "rope_local_parameters": local_rope,
    }


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict:
    """A plamo3 GGUF's tensors as the model holds them: the norms without their offsets."""
    out = {}
    for name, w in weights.items():
        part = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if part not in OFFSETS:
            out[name] = w
            continue
        if w.ggml_type is not None:
            raise ModelFormatError(
                f"tensor {name} is quantized ({w.ggml_type.name}); llama.cpp keeps PLaMo 3's "
                "norms in float"
            )
        out[name] = weight_type(w.tensor.float() - OFFSETS[part])
    return out
