"""MiniMax-Text-01 at the loader edge: Hugging Face folders, and "minimax-01" GGUFs as
llama.cpp's converter writes them (conversion/minimax.py MiniMaxText01Model) and
src/models/minimax-01.cpp reads them.

A folder saved by transformers 5 holds each lightning layer's decay tables
(slope_rate, query_decay, key_decay, diagonal_decay: buffers the model computes from
the config), which are dropped.

The GGUF: TextModel's keys, residual_scale (the one alpha of every block; the
converter asserts the betas are 1), rope.dimension_count (rotary_dim); the experts
stacked as Mixtral's. Which layers are lightning ones: attention.recurrent_layers where
the file has it, else all but every full_attention_interval-th (8 where absent, the
released models' layout, which the converter does not write), as llama.cpp's
load_arch_hparams reads them. Tensor names: a lightning layer's attn_qkv, attn_gate,
attn_norm_2 (the norm over its heads) and attn_output (its out_proj; a softmax layer's
o_proj), ffn_norm the norm before the experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH, MODEL_TYPE = "minimax-01", "minimax"
DEFAULT_FULL_ATTENTION_INTERVAL = 8  # llama_model_minimax_01::load_arch_hparams
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # not in gguf's Keys yet
_DECAY_TABLES = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",  # a lightning layer's: out_proj (gguf_weights)
    "attn_qkv": "self_attn.qkv_proj",
    "attn_gate": "self_attn.output_gate",
    "attn_norm_2": "self_attn.norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A folder's weights without the lightning layers' decay tables."""
    return {k: w for k, w in weights.items() if not k.endswith(_DECAY_TABLES)}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a minimax-01 GGUF tensor (a stack of experts: with an {expert}
    field; attn_output: the softmax layers' name), or None."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        return None
    name = _LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}.weight"


def gguf_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The file's weights with each lightning layer's attn_output under its name there
    (out_proj)."""
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        if name.endswith(".self_attn.o_proj.weight"):
            if config["layer_types"][int(parts[2])] == "linear_attention":
                name = name.replace(".o_proj.", ".out_proj.")
        out[name] = w
    return out


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style minimax config from a GGUF's metadata, as llama.cpp reads it: the
    RMSNorm epsilon and residual_scale required, heads embedding / heads wide where
    key_length is absent, partial RoPE from rope.dimension_count, the lightning layers
    (see the module's docstring). Refuses a file without experts, one whose lists of
    layers do not fit, and value heads wider or narrower than the keys."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    layers = meta.require(Keys.LLM.BLOCK_COUNT)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads, layers)):
        raise ModelFormatError(f"{path}: embedding, head and block counts must be positive")
    head_dim = meta.get(Keys.Attention.KEY_LENGTH) or hidden // heads
    if meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(f"{path}: MiniMax's value heads are as wide as its key heads")
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=ARCH)} is {used} and "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=ARCH)} {count}; MiniMax routes each token "
            "to 1 to expert_count experts"
        )
    recurrent = meta.get(RECURRENT_LAYERS)
    if recurrent is None:
        interval = meta.get(Keys.LLM.FULL_ATTENTION_INTERVAL, DEFAULT_FULL_ATTENTION_INTERVAL)
        if not isinstance(interval, int) or interval <= 0:
            raise ModelFormatError(
                f"{path}: {Keys.LLM.FULL_ATTENTION_INTERVAL.format(arch=ARCH)} is {interval!r}"
            )
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(recurrent, list) or len(recurrent) != layers:
        raise ModelFormatError(
            f"{path}: {RECURRENT_LAYERS.format(arch=ARCH)} does not list {layers} layers"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)

    alpha = meta.require(Keys.LLM.RESIDUAL_SCALE)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.require(Keys.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": context,
        "vocab_size": (len(tokens) if tokens else None) or (embed.shape[0] if embed else None),
        "tie_word_embeddings": "output.weight" not in gg.tensors,
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "full_attn_alpha_factor": alpha,
        "linear_attn_alpha_factor": alpha,
        "mlp_alpha_factor": alpha,
        "rope_parameters": rope_from_gguf(gg, meta, head_dim, context),
    }


def attention_layer_count(config: dict[str, Any]) -> int | None:
    """How many of a minimax config's layers are softmax attention ones (and so have a
    KV cache), as the model reads layer_types (MiniMaxConfig's default: every other
    layer, the first one of them); None for another config."""
    if config.get("model_type") != MODEL_TYPE:
        return None
    kinds = config.get("layer_types")
    if kinds is None:
        return (int(config["num_hidden_layers"]) + 1) // 2
    return sum(kind == "full_attention" for kind in kinds)
