"""Cohere's GGUFs ("command-r": Command-R, Command R+, Aya; "cohere2": Command R7B,
Command A) read as llama.cpp reads them (src/models/command-r.cpp, cohere2.cpp and
the general keys of llama-model.cpp) into llmrun's cohere and cohere2 configs.

llama.cpp's converter (conversion/command_r.py) stores q/k as they are: llama.cpp
rotates adjacent pairs for both architectures (LLAMA_ROPE_TYPE_NORM), as the Hugging
Face models do, so no tensor needs undoing and the usual tensor names map
(gguf_config.hf_name). The output matrix is always token_embd's.
"""

from __future__ import annotations

from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, vocab_size

# GGUF architecture -> Hugging Face model_type.
MODEL_TYPES = {"command-r": "cohere", "cohere2": "cohere2"}
# llama.cpp's cohere2: load_swa_pattern(ml, 4), three local layers to each global one.
COHERE2_SWA_PATTERN = 4
OUTPUT = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
Q_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q_NORM].format(bid=0) + ".weight"
ROPE_FACTORS = tuple(
    TENSOR_NAMES[t] + ".weight"
    for t in (
        MODEL_TENSOR.ROPE_FREQS,
        MODEL_TENSOR.ROPE_FACTORS_LONG,
        MODEL_TENSOR.ROPE_FACTORS_SHORT,
    )
)


def config_from_gguf(gg, rope_from_gguf, layer_types) -> dict[str, Any]:
    """An HF-style cohere or cohere2 config from a GGUF's metadata. `rope_from_gguf` and
    `layer_types` are gguf_config's readers of the RoPE keys and of a sliding-window
    pattern."""
    arch, path = gg.architecture, gg.path
    meta = ArchMetadata.of(gg)
    for name in (OUTPUT, *ROPE_FACTORS):
        if name in gg.tensors:
            raise UnsupportedError(
                f"{path}: tensor {name!r} is not part of llama.cpp's {arch} model, "
                "which llmrun follows"
            )
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = meta.require(Keys.Attention.HEAD_COUNT)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    if not (isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0):
        raise ModelFormatError(
            f"{path}: an embedding length of {hidden!r} and a head count of {n_heads!r} "
            "are not positive whole numbers"
        )
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: keys and values of different lengths are not supported")
    if arch == "cohere2" and head_dim * n_heads != hidden:
        raise UnsupportedError(
            f"{path}: a cohere2 head of {head_dim} features is not hidden size / heads "
            f"({hidden} / {n_heads}), the only one Cohere 2 has"
        )
    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{path}: {Keys.Rope.DIMENSION_COUNT.format(arch=arch)} rotates "
            f"{round(rope['partial_rotary_factor'] * head_dim)} of {head_dim} features a head; "
            "llmrun's Cohere models rotate them all"
        )
    # Absent or 0, llama.cpp leaves the logits unscaled (`if (f_logit_scale)`).
    scale_key = Keys.LLM.LOGIT_SCALE
    logit_scale = (meta.require(scale_key) if arch == "cohere2" else meta.get(scale_key)) or 1.0
    config = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads),
        "head_dim": head_dim,
        "layer_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "logit_scale": logit_scale,
        "tie_word_embeddings": True,
        "attention_bias": TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].format(bid=0) + ".bias" in gg.tensors,
        # llama.cpp loads the q/k norms of a command-r file with 64 layers or more (Command
        # R+); llmrun takes them wherever the file has them.
        "use_qk_norm": Q_NORM in gg.tensors,
        "rope_parameters": rope,
    }
    if arch == "cohere2":
        base_swa = meta.get(Keys.Rope.FREQ_BASE_SWA)
        if base_swa is not None and base_swa != rope["rope_theta"]:
            raise UnsupportedError(
                f"{path}: {Keys.Rope.FREQ_BASE_SWA.format(arch=arch)} differs from "
                f"{Keys.Rope.FREQ_BASE.format(arch=arch)}; Cohere 2 has one RoPE base"
            )
        config["sliding_window"] = meta.require(Keys.Attention.SLIDING_WINDOW)
        config["layer_types"] = layer_types(gg, meta, layers, COHERE2_SWA_PATTERN)
    return config
