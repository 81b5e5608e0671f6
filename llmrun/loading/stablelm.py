"""StableLM GGUFs (arch "stablelm") as llama.cpp's converter writes them
(conversion/stablelm.py StableLMModel: its own keys, which give the rotated features of a
head as rope.dimension_count and no RoPE base, so llama.cpp's 10000; q/k rows as they are,
for llama.cpp's NEOX RoPE; each layer's per-head q/k LayerNorms stacked into one
[heads, head_dim] attn_q_norm / attn_k_norm), read as src/models/stablelm.cpp and
llama_model_stablelm::load_arch_hparams read them: the LayerNorm epsilon required, q/k
norms and q/k/v biases where the file has them, and a layer without ffn_norm parallel.
The use_parallel_residual key is not read, by llama.cpp either: the converter writes
true where a config leaves the field out, which transformers reads as false.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

ARCH = MODEL_TYPE = "stablelm"
# GGUF layer tensor -> the HF module of the stacked per-head norms (gguf_weights splits them).
_NORMS = {
    TENSOR_NAMES[MODEL_TENSOR.ATTN_Q_NORM].split(".")[-1]: "self_attn.q_layernorm",
    TENSOR_NAMES[MODEL_TENSOR.ATTN_K_NORM].split(".")[-1]: "self_attn.k_layernorm",
}
# Tensors a layer has or lacks by the model's config: q/k/v biases, q/k norms, and the
# feed-forward's own norm (none in a parallel block).
_Q_BIAS = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q] + ".bias"
_Q_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_Q_NORM] + ".weight"
_K_NORM = TENSOR_NAMES[MODEL_TENSOR.ATTN_K_NORM] + ".weight"
_FFN_NORM = TENSOR_NAMES[MODEL_TENSOR.FFN_NORM] + ".weight"
_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (StableLmConfig's fields) of a stablelm GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    kv_heads = meta.get(Keys.Attention.HEAD_COUNT_KV, heads)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads, kv_heads, layers)):
        raise ModelFormatError(
            f"{gg.path}: an embedding length of {hidden!r}, {heads!r} heads, {kv_heads!r} KV "
            f"heads and {layers!r} layers are not all positive whole numbers (one for all layers)"
        )
    head_dim = hidden // heads
    for length in (Keys.Attention.KEY_LENGTH, Keys.Attention.VALUE_LENGTH):
        if meta.get(length, head_dim) != head_dim:
            raise UnsupportedError(
                f"{gg.path}: {length.format(arch=ARCH)} is not the hidden size / heads "
                f"({hidden} / {heads}), the only head size StableLM has"
            )
    rope = rope_from_gguf(gg, meta, head_dim, context)
    # Without a dimension count llama.cpp turns whole heads, not StableLmConfig's quarter.
    rope.setdefault("partial_rotary_factor", 1.0)
    qk_norms = _every_layer_or_none(gg, _Q_NORM, layers)
    if qk_norms != _every_layer_or_none(gg, _K_NORM, layers):
        raise ModelFormatError(f"{gg.path}: q norms without k norms, or k norms without q norms")
    if qk_norms:
        _check_head_norms(gg, layers, heads, kv_heads, head_dim)
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "layer_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "max_position_embeddings": context,
        "vocab_size": vocab_size(gg, meta),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "use_qkv_bias": _every_layer_or_none(gg, _Q_BIAS, layers),
        "qk_layernorm": qk_norms,
        "use_parallel_residual": not _every_layer_or_none(gg, _FFN_NORM, layers),
        "rope_parameters": rope,
    }


def _every_layer_or_none(gg: GGUFFile, template: str, layers: int) -> bool:
    """Whether the layers have tensor `template` (a "blk.{bid}...." name); refused where
    some have it and others not, which llama.cpp runs layer by layer but no StableLM
    config describes."""
    have = [template.format(bid=i) in gg.tensors for i in range(layers)]
    if any(have) and not all(have):
        raise UnsupportedError(
            f"{gg.path}: {template.format(bid='N')} is in {sum(have)} of {layers} layers; "
            "llmrun's StableLM has it in every layer or in none"
        )
    return all(have)


def _check_head_norms(gg: GGUFFile, layers: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Refuse q/k norms that are not floats of [heads, head_dim], as the converter
    stacks them (F32, like every norm it writes)."""
    for template, rows in ((_Q_NORM, heads), (_K_NORM, kv_heads)):
        for i in range(layers):
            info = gg.tensors[template.format(bid=i)]
            if info.ggml_type not in _FLOATS:
                raise UnsupportedError(
                    f"{gg.path}: {info.name} in {info.ggml_type.name}; llmrun reads StableLM's "
                    "per-head norms as floats (llama.cpp's converter writes them in F32)"
                )
            if tuple(info.shape) != (rows, head_dim):
                raise ModelFormatError(
                    f"{gg.path}: {info.name} has shape {list(info.shape)}, not one norm of "
                    f"{head_dim} features for each of {rows} heads"
                )


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a layer's stacked q/k norms (split by gguf_weights), else None."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NORMS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_NORMS[parts[2]]}.weight"
    return None


def gguf_weights(weights: dict[str, Any], weight_type: type) -> dict[str, Any]:
    """A stablelm GGUF's tensors as the model holds them: each stacked q/k norm [heads,
    head_dim] (checked by config_from_gguf) as its heads' `norms.N.weight`, the rest as
    they are."""
    out = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if module.endswith(tuple(_NORMS.values())):
            for head, row in enumerate(w.tensor):
                out[f"{module}.norms.{head}.weight"] = weight_type(row)
        else:
            out[name] = w
    return out
