"""Nemotron-NAS GGUFs (arch "deci": Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B,
Llama-3.1-Nemotron-Ultra-253B; DeciLM-7B) as llama.cpp's converter writes them
(conversion/deci.py DeciModel), read as src/models/deci.cpp reads them.

The converter writes, per layer, head_count (0 where attention is a no_op),
head_count_kv (0 where it is a no_op or a linear map) and feed_forward_length (the
width ffn_mult gives, 0 where the feed-forward is a no_op); DeciLM-7B's files have one
head count and width for all. A linear attention is stored as attn_output (a square
matrix, self_attn.linear_attn), q/k rows permuted for llama.cpp's adjacent-pair RoPE
with each layer's own head counts, Llama 3.1 scaling as a rope_freqs tensor. The
converter has no name for a linear feed-forward (mlp.linear_mlp), so no file has one.

llama.cpp's graph skips the whole layer where the width is 0 (its attention's output
is dropped), which the checkpoints' remote code does not: such a layer with attention
is refused. A layer with KV heads but no heads, or head counts that differ between
layers, is refused too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import exaone
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = "deci"
MODEL_TYPE = "nemotron-nas"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict[str, Any]]) -> dict:
    """The HF-style config (the remote code's DeciLMConfig fields, block_configs with
    each feed-forward's width as intermediate_size) of a deci GGUF; rope_from_gguf is
    gguf_config's reader of the RoPE keys."""
    meta = ArchMetadata.of(gg, ARCH)

    def per_layer(template: str, default: Any = None) -> list[int]:
        """A key llama.cpp reads with get_key_or_arr: one value for every layer, or one
        per layer."""
        value = meta.require(template) if default is None else meta.get(template, default)
        values = value if isinstance(value, list) else [value] * layers
        if len(values) != layers or not all(_count(v) for v in values):
            raise ModelFormatError(
                f"{gg.path}: {template.format(arch=ARCH)} is {value!r:.80}, not a count or "
                f"a list of {layers} counts"
            )
        return values

    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = per_layer(Keys.Attention.HEAD_COUNT)
    kv_heads = per_layer(Keys.Attention.HEAD_COUNT_KV, heads)
    widths = per_layer(Keys.LLM.FEED_FORWARD_LENGTH)
    attending = sorted(set(heads) - {0})
    if len(attending) != 1:
        raise UnsupportedError(
            f"{gg.path}: {Keys.Attention.HEAD_COUNT.format(arch=ARCH)} is {heads}; llmrun "
            "supports one head count for every layer with attention"
        )
    n_heads = attending[0]
    blocks = [
        _block(gg, i, h, kv, width)
        for i, (h, kv, width) in enumerate(zip(heads, kv_heads, widths, strict=True))
    ]
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // n_heads
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "head_dim": head_dim,
        "block_configs": blocks,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": meta.get(Keys.LLM.VOCAB_SIZE) or (len(tokens) if tokens else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "attention_bias": any(_layer_tensor(gg, i, "attn_q.bias") for i in range(layers)),
        "mlp_bias": any(_layer_tensor(gg, i, "ffn_up.bias") for i in range(layers)),
    }
    config["rope_parameters"] = rope_from_gguf(gg, meta, head_dim, context)
    # llama.cpp turns whole heads (it refuses another rope dimension count) and applies
    # YaRN its own way: as for EXAONE, what it would compute otherwise is refused.
    exaone.check_rope(gg, config, meta, "Nemotron-NAS")
    return config


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _layer_tensor(gg: GGUFFile, layer: int, name: str) -> bool:
    return f"blk.{layer}.{name}" in gg.tensors


def _block(gg: GGUFFile, layer: int, heads: int, kv_heads: int, width: int) -> dict[str, Any]:
    """The block_configs entry of a layer with these head counts and feed-forward width."""
    if heads == 0 and kv_heads:
        raise ModelFormatError(
            f"{gg.path}: layer {layer} has {kv_heads} KV heads but no attention heads"
        )
    if heads and kv_heads and heads % kv_heads:
        raise ModelFormatError(
            f"{gg.path}: layer {layer}'s {heads} heads cannot share {kv_heads} KV heads"
        )
    if width == 0 and heads:
        raise UnsupportedError(
            f"{gg.path}: layer {layer} has attention but no feed-forward; llama.cpp drops "
            "such a layer's attention and the checkpoint's own code keeps it, so llmrun "
            "does not guess which the file means"
        )
    if heads == 0:
        attention: dict[str, Any] = {"no_op": True}
    elif kv_heads == 0:
        attention = {"replace_with_linear": True}
    else:
        attention = {"n_heads_in_group": heads // kv_heads}
    ffn = {"no_op": True} if width == 0 else {"intermediate_size": width}
    return {"attention": attention, "ffn": ffn}


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A deci GGUF's tensors as the model holds them: each layer's q/k rows unpermuted
    with its own head counts, a linear attention's attn_output as self_attn.linear_attn.
    `weight_type` wraps a tensor (loader.Weight)."""
    from llmrun.loading.gguf_io import unpermute_rows

    heads = config["num_attention_heads"]
    out = {}
    for name, w in weights.items():
        if not name.startswith("model.layers."):
            out[name] = w
            continue
        layer, part = name.removeprefix("model.layers.").split(".", 1)
        attention = config["block_configs"][int(layer)]["attention"]
        if attention.get("replace_with_linear") and part == "self_attn.o_proj.weight":
            out[f"model.layers.{layer}.self_attn.linear_attn.weight"] = w
            continue
        rows = {"q_proj": heads, "k_proj": heads // attention.get("n_heads_in_group", 1)}
        projection = part.removeprefix("self_attn.").split(".")[0]
        if part.startswith("self_attn.") and projection in rows:
            try:
                tensor = unpermute_rows(w.tensor, rows[projection])
            except ModelFormatError as e:
                raise ModelFormatError(f"{name}: {e}") from None
            out[name] = weight_type(tensor, w.ggml_type, w.shape)
            continue
        out[name] = w
    return out
