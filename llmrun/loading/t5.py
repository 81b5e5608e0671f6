"""T5 at the loader edge (T5, mT5, UMT5, LongT5 and Switch Transformers text-to-text
models): a Hugging Face folder's tensors under llmrun.models.t5's names (the output head the
shared embedding where the file leaves it out, the stacks' own embed_tokens copies of it
dropped), llama.cpp's t5 GGUFs (their metadata as a T5 config.json, their tensors under the
same names), and what `show` says of one."""

from __future__ import annotations

import re
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from llmrun.errors import UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile, vocab_size

MODEL_TYPES = ("t5", "mt5", "umt5", "longt5", "switch_transformers")
SHARED, HEAD = "shared.weight", "lm_head.weight"
# Copies of `shared` some files keep, and a table transformers ignores on load.
DROPPED = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """The folder's tensors as llmrun's T5 model names them."""
    out = {k: w for k, w in weights.items() if k not in DROPPED}
    if SHARED not in out:
        for name in DROPPED[:2]:  # a file that kept only a stack's copy
            if name in weights:
                out[SHARED] = weights[name]
                break
    if HEAD not in out and SHARED in out:
        out[HEAD] = out[SHARED]
    return out


def info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a T5 folder or GGUF (its config): text-to-text, its
    layers."""
    if config.get("model_type") not in MODEL_TYPES:
        return {}
    decoder = config.get("num_decoder_layers") or config.get("num_layers")
    return {
        "text_to_text": (
            f"text-to-text (encoder-decoder): {config.get('num_layers')} encoder and "
            f"{decoder} decoder layers"
        ),
        "embedding_model": False,
    }


ARCH = "t5"  # llama.cpp's arch of T5, mT5 and UMT5 GGUFs (conversion/t5.py)
# llama.cpp's fixed relative_attention_max_distance (llama_relative_position_bucket): the
# GGUF does not carry it.
MAX_DISTANCE = 128
_BLOCK = re.compile(r"(enc|dec)\.blk\.(\d+)\.(.+)")
_WHOLE = {
    TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: "shared",
    TENSOR_NAMES[MODEL_TENSOR.OUTPUT]: "lm_head",
    TENSOR_NAMES[MODEL_TENSOR.ENC_OUTPUT_NORM]: "encoder.final_layer_norm",
    TENSOR_NAMES[MODEL_TENSOR.DEC_OUTPUT_NORM]: "decoder.final_layer_norm",
}
# A block's tensors after "enc.blk.N." / "dec.blk.N." -> the HF key after "encoder.block.N."
# / "decoder.block.N." (ffn_up is `wi`, renamed `wi_1` where a gate makes it gated).
_PARTS = {
    MODEL_TENSOR.ENC_ATTN_NORM: "layer.0.layer_norm",
    MODEL_TENSOR.ENC_ATTN_Q: "layer.0.SelfAttention.q",
    MODEL_TENSOR.ENC_ATTN_K: "layer.0.SelfAttention.k",
    MODEL_TENSOR.ENC_ATTN_V: "layer.0.SelfAttention.v",
    MODEL_TENSOR.ENC_ATTN_OUT: "layer.0.SelfAttention.o",
    MODEL_TENSOR.ENC_ATTN_REL_B: "layer.0.SelfAttention.relative_attention_bias",
    MODEL_TENSOR.ENC_FFN_NORM: "layer.1.layer_norm",
    MODEL_TENSOR.ENC_FFN_GATE: "layer.1.DenseReluDense.wi_0",
    MODEL_TENSOR.ENC_FFN_UP: "layer.1.DenseReluDense.wi",
    MODEL_TENSOR.ENC_FFN_DOWN: "layer.1.DenseReluDense.wo",
    MODEL_TENSOR.DEC_ATTN_NORM: "layer.0.layer_norm",
    MODEL_TENSOR.DEC_ATTN_Q: "layer.0.SelfAttention.q",
    MODEL_TENSOR.DEC_ATTN_K: "layer.0.SelfAttention.k",
    MODEL_TENSOR.DEC_ATTN_V: "layer.0.SelfAttention.v",
    MODEL_TENSOR.DEC_ATTN_OUT: "layer.0.SelfAttention.o",
    MODEL_TENSOR.DEC_ATTN_REL_B: "layer.0.SelfAttention.relative_attention_bias",
    MODEL_TENSOR.DEC_CROSS_ATTN_NORM: "layer.1.layer_norm",
    MODEL_TENSOR.DEC_CROSS_ATTN_Q: "layer.1.EncDecAttention.q",
    MODEL_TENSOR.DEC_CROSS_ATTN_K: "layer.1.EncDecAttention.k",
    MODEL_TENSOR.DEC_CROSS_ATTN_V: "layer.1.EncDecAttention.v",
    MODEL_TENSOR.DEC_CROSS_ATTN_OUT: "layer.1.EncDecAttention.o",
    MODEL_TENSOR.DEC_CROSS_ATTN_REL_B: "layer.1.EncDecAttention.relative_attention_bias",
    MODEL_TENSOR.DEC_FFN_NORM: "layer.2.layer_norm",
    MODEL_TENSOR.DEC_FFN_GATE: "layer.2.DenseReluDense.wi_0",
    MODEL_TENSOR.DEC_FFN_UP: "layer.2.DenseReluDense.wi",
    MODEL_TENSOR.DEC_FFN_DOWN: "layer.2.DenseReluDense.wo",
}
_BLOCK_PARTS = {
    (TENSOR_NAMES[t].split(".")[0], TENSOR_NAMES[t].rpartition(".")[2]): part
    for t, part in _PARTS.items()
}
_STACKS = {"enc": "encoder", "dec": "decoder"}


def hf_name(gguf_name: str) -> str | None:
    """The HF key of a t5 GGUF tensor, None where T5 has none."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _WHOLE:
        return f"{_WHOLE[base]}.weight"
    match = _BLOCK.fullmatch(base)
    part = match and _BLOCK_PARTS.get((match[1], match[3]))
    return f"{_STACKS[match[1]]}.block.{match[2]}.{part}.weight" if part else None


def gguf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A t5 GGUF's tensors under llmrun's names: a gated feed-forward's up projection is
    `wi_1`, and what hf_weights drops of a folder is dropped here too."""
    gated = any(k.endswith("DenseReluDense.wi_0.weight") for k in weights)
    if gated:
        weights = {
            k.replace("DenseReluDense.wi.weight", "DenseReluDense.wi_1.weight"): w
            for k, w in weights.items()
        }
    return hf_weights(weights)


def config_from_gguf(gg: GGUFFile) -> dict[str, Any]:
    """An HF-style T5 config.json dict from a t5 GGUF, read as llama.cpp's load_hparams and
    src/models/t5.cpp read it: a gated GELU feed-forward where the file has ffn_gate, else
    ReLU; a bias table in every layer (UMT5) or the first alone; relative positions up to
    llama.cpp's fixed distance. The output is scaled by d_model**-0.5 where the file has no
    output head of its own (transformers' T5 v1.0 ties it), as transformers scales it;
    llama.cpp never scales, which changes no greedy token."""
    meta = ArchMetadata.of(gg)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    key_length = meta.require(Keys.Attention.KEY_LENGTH)
    if meta.get(Keys.Attention.VALUE_LENGTH, key_length) != key_length:
        raise UnsupportedError(f"{gg.path}: a T5 whose keys and values differ in width")
    gated = TENSOR_NAMES[MODEL_TENSOR.ENC_FFN_GATE].format(bid=0) + ".weight" in gg.tensors
    per_layer = TENSOR_NAMES[MODEL_TENSOR.ENC_ATTN_REL_B].format(bid=1) + ".weight"
    head = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
    return {
        "model_type": "umt5" if layers > 1 and per_layer in gg.tensors else "t5",
        "vocab_size": vocab_size(gg, meta),
        "d_model": meta.require(Keys.LLM.EMBEDDING_LENGTH),
        "d_kv": key_length,
        "d_ff": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_layers": layers,
        "num_decoder_layers": meta.get(Keys.LLM.DECODER_BLOCK_COUNT, layers),
        "num_heads": heads,
        "relative_attention_num_buckets": meta.require(Keys.Attention.REL_BUCKETS_COUNT),
        "relative_attention_max_distance": MAX_DISTANCE,
        "layer_norm_epsilon": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "feed_forward_proj": "gated-gelu" if gated else "relu",
        "decoder_start_token_id": meta.get(Keys.LLM.DECODER_START_TOKEN_ID, 0),
        "scale_decoder_outputs": head not in gg.tensors,
        "eos_token_id": gg.metadata.get(Keys.Tokenizer.EOS_ID),
    }
