"""Qwen4-Exp at the loader edge: Hugging Face folders (a text-only Qwen4ExpForCausalLM,
model_type qwen4_exp_text, or the language model of Qwen4ExpForConditionalGeneration,
qwen4_exp) and GGUFs of llama.cpp's arch "qwen4exp" as its converter writes them
(conversion/qwen4exp.py over Qwen3.5-MoE's conversion/qwen.py), read as
src/models/qwen4exp.cpp reads them.

A folder is Qwen3.5-MoE's (llmrun.loading.qwen35.hf_checkpoint: text_config, the
language model's prefix, experts fused by transformers 5 split), plus: each PLE layer's
n-gram table, which the Hub's files keep in split_ngram_parts row shards
(ngram_embedding.shard_N.weight, joined in N's order as transformers joins them); and
the n-gram hash's constants (layer_multipliers, ngram_heads_vocab_sizes,
ngram_heads_offsets), which llmrun computes from the config as transformers does and
checks against the file's. transformers' index_qk_proj is split into the queries' and
the key's rows, as llama.cpp's converter splits it.

A GGUF is Qwen3.5-MoE's (llmrun.loading.qwen35: its keys, value heads tiled, norms
stored as 1 + w, A_log as -exp(A_log), convolutions squeezed), plus: the hyper-connection
count and rank; the indexer's heads, key length and top_k (the token budget), and per
layer its compress ratio (0 on the linear-attention layers); the PLE keys (ple.layers,
zero-indexed and at most one, as llama.cpp reads them; the n-gram size, heads per
order, convolution kernel, EOS id and the hash's constants, which the model takes from
the file) and the n-gram table as the global per_layer_token_embd. The converter adds 1
to the PLE and indexer norms too. llama.cpp's graph gates the Gated DeltaNet's output by
sigmoid (the converter writes no output_gate_type), which the config says here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import qwen35
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "qwen4exp", "qwen4_exp"
MODEL_TYPES = (MODEL_TYPE, "qwen4_exp_text")
_SHARD = re.compile(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight")
HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_FUSED_INDEXER = "index_qk_proj.weight"


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight_type: type
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A Qwen4-Exp folder's language-model config and weights under the model's names,
    and whether the folder had a vision tower."""
    import torch  # here: llmrun list and show import this module without torch

    from llmrun.models import qwen4_exp

    config, weights, multimodal = qwen35.hf_checkpoint(config, weights, weight_type)
    args = qwen4_exp.ModelArgs.from_config(config)
    shards: dict[str, dict[int, Any]] = {}
    out = {}
    for name, w in weights.items():
        match = _SHARD.fullmatch(name)
        if match:
            shards.setdefault(match[1], {})[int(match[2])] = w
        elif name.endswith(HASH_BUFFERS):
            _check_hash_buffer(name, w, args)
        elif name.endswith(_FUSED_INDEXER):
            queries = args.indexer_n_heads * args.indexer_head_dim
            base = name.removesuffix(_FUSED_INDEXER)
            out[f"{base}index_q_proj.weight"] = weight_type(w.tensor[:queries])
            out[f"{base}index_k_proj.weight"] = weight_type(w.tensor[queries:])
        else:
            out[name] = w
    expected = config.get("split_ngram_parts")
    for table, parts in shards.items():
        if expected is not None and sorted(parts) != list(range(int(expected))):
            raise ModelFormatError(
                f"{table}: shards {sorted(parts)}, but split_ngram_parts is {expected}"
            )
        joined = torch.cat([parts[i].tensor for i in sorted(parts)], dim=0)
        out[f"{table}.weight"] = weight_type(joined)
    return config, out, multimodal


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many layers of a Qwen4-Exp config.json-style dict keep keys and values (its
    full-attention ones, indexed_attention as transformers names them); None for another
    family."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    kinds = config.get("layer_types")
    if kinds:
        return sum(kind != "linear_attention" for kind in kinds)
    interval = int(config.get("full_attention_interval") or qwen35.FULL_ATTENTION_INTERVAL)
    return int(config["num_hidden_layers"]) // interval


def _check_hash_buffer(name: str, w: Any, args: Any) -> None:
    """The file's hash constant `name` equals what llmrun computes from the config
    (`args`, the model's)."""
    layer = int(name.split(".")[2])
    index = args.ple_layer_ids.index(layer + 1) if layer + 1 in args.ple_layer_ids else None
    if index is None:
        raise ModelFormatError(f"{name}: layer {layer} has no PLE (ple_layer_ids)")
    kind = name.rsplit(".", 1)[1]
    computed = {
        "layer_multipliers": args.ple_multipliers,
        "ngram_heads_vocab_sizes": args.ple_head_vocab_sizes,
        "ngram_heads_offsets": args.ple_head_offsets,
    }[kind][index]
    if [int(x) for x in w.tensor.tolist()] != computed:
        raise ModelFormatError(
            f"{name} is not the n-gram hash's constant transformers computes from the "
            "config (seed, ngram_vocab_size_base, vocab_size)"
        )


# llama.cpp's keys (gguf-py's constants.py; newer than the gguf package here).
HC_COUNT, HC_LOW_RANK = "{arch}.hyper_connection.count", "{arch}.hyper_connection.low_rank"
INDEXER_HEADS = "{arch}.attention.indexer.head_count"
INDEXER_KEY_LENGTH = "{arch}.attention.indexer.key_length"
INDEXER_TOP_K = "{arch}.attention.indexer.top_k"
COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
PLE_LAYERS, PLE_NGRAM_SIZE = "{arch}.ple.layers", "{arch}.ple.ngram_size"
PLE_HEADS_PER_NGRAM, PLE_CONV_KERNEL = "{arch}.ple.heads_per_ngram", "{arch}.ple.conv_kernel"
PLE_MULTIPLIERS, PLE_EOS = "{arch}.ple.layer_multipliers", "{arch}.ple.eos_token_id"
PLE_OFFSETS, PLE_VOCAB_SIZES = "{arch}.ple.head_offsets", "{arch}.ple.head_vocab_sizes"
PLE_TABLE = TENSOR_NAMES[MODEL_TENSOR.PER_LAYER_TOKEN_EMBD] + ".weight"
_TABLE = "model.ple_table.weight"  # the table until gguf_weights places it in its layer

# GGUF tensor (global, or after blk.N.) -> llmrun's module.
_GLOBAL_NAMES = {
    "output_hc_norm": "model.hyper_connection_mixer.hc_norm",
    "output_hc_down": "model.hyper_connection_mixer.input_mix_weight_down",
    "output_hc_up": "model.hyper_connection_mixer.input_mix_weight_up",
}
_LAYER_NAMES = {
    **{
        f"hc_{short}_{part}": f"{long}_hyper_connection.{name}"
        for short, long in (("attn", "attn"), ("ffn", "mlp"))
        for part, name in (
            ("norm", "hc_norm"),
            ("down", "input_mix_weight_down"),
            ("up", "input_mix_weight_up"),
            ("inject", "block_inject_weight"),
        )
    },
    "indexer.q_proj": "self_attn.indexer.index_q_proj",
    "indexer.k_proj": "self_attn.indexer.index_k_proj",
    "indexer.q_norm": "self_attn.indexer.q_layernorm",
    "indexer.k_norm": "self_attn.indexer.k_layernorm",
    "ple_key": "ple.key_proj",
    "ple_value": "ple.value_proj",
    "ple_norm_key": "ple.norm_key",
    "ple_norm_query": "ple.norm_query",
    "ple_norm_conv": "ple.norm_conv",
    "ple_conv1d": "ple.conv1d",
}
_PLE_NORMS = ("ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight")


def hf_name(gguf_name: str) -> str | None:
    """llmrun's state-dict key for a tensor of a qwen4exp GGUF (qwen35.hf_name's for
    those Qwen3.5-MoE has), or None if the model has no such tensor."""
    if gguf_name == PLE_TABLE:
        return _TABLE
    base, _, suffix = gguf_name.rpartition(".")
    if suffix == "weight" and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.weight"
    parts = base.split(".", 2)
    if suffix == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return qwen35.hf_name(gguf_name)


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """The HF-style config of a qwen4exp GGUF, read as llama_model_qwen4exp::
    load_arch_hparams reads it (rope_from_gguf: gguf_config's RoPE reader)."""
    config = qwen35.config_from_gguf(gg, rope_from_gguf, MODEL_TYPE)
    arch = gg.architecture
    meta = ArchMetadata.of(gg)
    layers = config["num_hidden_layers"]
    ratios = meta.get(COMPRESS_RATIOS)
    ratios = [ratios] * layers if isinstance(ratios, int) else list(ratios or [])
    attending = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    chosen = {ratios[i] for i in attending if i < len(ratios)}
    if len(ratios) < layers or len(chosen) != 1 or 0 in chosen:
        raise UnsupportedError(
            f"{gg.path}: {COMPRESS_RATIOS.format(arch=arch)} is {ratios}; llmrun runs one "
            "positive QSA compress ratio on every full-attention layer"
        )
    config.update(
        hc_count=meta.require(HC_COUNT),
        hc_lowrank=meta.require(HC_LOW_RANK),
        indexer_n_heads=meta.require(INDEXER_HEADS),
        indexer_kv_heads=1,
        indexer_head_dim=meta.require(INDEXER_KEY_LENGTH),
        indexer_budget=meta.require(INDEXER_TOP_K),
        indexer_compress_ratio=chosen.pop(),
        output_gate_type="sigmoid",
    )
    ple_layers = meta.get(PLE_LAYERS) or []
    if len(ple_layers) > 1:
        raise UnsupportedError(
            f"{gg.path}: {PLE_LAYERS.format(arch=arch)} lists {len(ple_layers)} layers; a "
            "qwen4exp GGUF holds one PLE table (llama.cpp reads one)"
        )
    if ple_layers:
        table = gg.tensors.get(PLE_TABLE)
        if table is None:
            raise ModelFormatError(f"{gg.path}: tensor {PLE_TABLE!r} is missing")
        size, per_order = meta.require(PLE_NGRAM_SIZE), meta.require(PLE_HEADS_PER_NGRAM)
        heads = (size - 1) * per_order
        config.update(
            ple_layer_ids=[int(ple_layers[0]) + 1],
            ngram_size=size,
            heads_per_ngram=per_order,
            ple_conv_kernel_size=meta.require(PLE_CONV_KERNEL),
            eos_token_id=meta.require(PLE_EOS),
            ple_embed_dim=heads * int(table.shape[1]),
            ple_multipliers=[[int(m) for m in meta.require(PLE_MULTIPLIERS)[:size]]],
            ple_head_vocab_sizes=[[int(v) for v in meta.require(PLE_VOCAB_SIZES)[:heads]]],
            ple_head_offsets=[[int(o) for o in meta.require(PLE_OFFSETS)[:heads]]],
            ple_table_rows=[int(table.shape[0])],
        )
    return config


def gguf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """The GGUF's weights as the model takes them: Qwen3.5's undoing (qwen35.gguf_weights),
    the PLE norms less 1 too, the n-gram table in its layer."""
    out = {}
    for name, w in qwen35.gguf_weights(weights, config, weight_type).items():
        if name.endswith(_PLE_NORMS):
            w = weight_type(w.tensor.float() - 1.0)
        if name == _TABLE:
            if not config.get("ple_layer_ids"):
                raise ModelFormatError(f"{PLE_TABLE} without {PLE_LAYERS.format(arch=ARCH)}")
            layer = config["ple_layer_ids"][0] - 1
            name = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
        out[name] = w
    return out
