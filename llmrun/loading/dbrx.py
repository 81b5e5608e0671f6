"""DBRX at the loader edge: the Hub's checkpoints, and "dbrx" GGUFs as llama.cpp's
converter writes them (conversion/dbrx.py) and src/models/dbrx.cpp reads them.

The Hub's keys (transformer.blocks.N.norm_attn_norm.attn.Wqkv, ffn.router.layer,
ffn.experts.mlp.w1/v1/w2, transformer.wte, transformer.norm_f) become llmrun's dbrx
module names; each layer's experts are one [experts * width, hidden] tensor per
projection there, w2 (the down projection) stored transposed, [in, out] per expert.

The GGUF: the fused attn_qkv as it is (rows of queries, keys, values; no permutation,
llama.cpp turns DBRX with NEOX RoPE), attn_output_norm the norm before the experts,
the experts stacked [experts, width, hidden] (gate, up) and [experts, hidden, width]
(down, the converter transposes w2). Metadata: TextModel's shape keys, the RoPE base
(10000 where absent, llama.cpp's default), attention.clamp_kqv (0: no clamp) and the
LayerNorm epsilon (both required, as llama.cpp requires them), the expert counts. The
graph always renormalizes the top-k softmax weights to sum to 1 and never scales them,
whatever the expert_weights_* keys say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "dbrx"

# The Hub's key of a layer module (after transformer.blocks.N.) -> llmrun's (after
# model.layers.N.)
_HUB_LAYER_NAMES = {
    "norm_attn_norm.norm_1": "input_layernorm",
    "norm_attn_norm.attn.Wqkv": "self_attn.Wqkv",
    "norm_attn_norm.attn.out_proj": "self_attn.out_proj",
    "norm_attn_norm.norm_2": "post_attention_layernorm",
    "ffn.router.layer": "mlp.gate",
}
_HUB_GLOBAL_NAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.norm_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# The Hub's fused experts -> each expert's projection: w1 the gate, v1 the up, w2 the down.
_HUB_EXPERTS = {"w1": "w1", "v1": "w3", "w2": "w2"}
# GGUF tensor -> llmrun's name (a layer's under model.layers.N.; {expert}: each expert's)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.Wqkv",
    "attn_output": "self_attn.out_proj",
    "attn_output_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.w1",
    "ffn_up_exps": "mlp.experts.{expert}.w3",
    "ffn_down_exps": "mlp.experts.{expert}.w2",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hub_tensors(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The Hub's tensors (torch tensors, or anything with their view/t methods) under
    llmrun's names, each expert's projections views of the fused ones ([out, in]: w2's
    transposed copies). Refuses a key that is not DBRX's, and fused experts whose shape
    the config does not give."""
    ffn = config.get("ffn_config") or {}
    hidden = config.get("d_model")
    experts, width = ffn.get("moe_num_experts"), ffn.get("ffn_hidden_size")
    out = {}
    for key, tensor in tensors.items():
        if key in _HUB_GLOBAL_NAMES:
            out[_HUB_GLOBAL_NAMES[key]] = tensor
            continue
        parts = key.split(".")
        if len(parts) < 4 or parts[:2] != ["transformer", "blocks"] or not parts[2].isdigit():
            raise ModelFormatError(f"tensor {key!r} is not part of a DBRX checkpoint")
        layer, rest = f"model.layers.{parts[2]}", ".".join(parts[3:])
        module, _, suffix = rest.rpartition(".")
        if module in _HUB_LAYER_NAMES and suffix == "weight":
            out[f"{layer}.{_HUB_LAYER_NAMES[module]}.weight"] = tensor
        elif module == "ffn.experts.mlp" and suffix in _HUB_EXPERTS:
            if tuple(tensor.shape) != (experts * width, hidden):
                raise ModelFormatError(
                    f"{key} has shape {list(tensor.shape)}, but the config implies "
                    f"[{experts} * {width}, {hidden}] (moe_num_experts, ffn_hidden_size, d_model)"
                )
            stack = tensor.view(experts, width, hidden)
            for e in range(experts):
                # w2 is each expert's down projection [in, out]: the module's is [out, in].
                expert = stack[e].t().contiguous() if suffix == "w2" else stack[e]
                out[f"{layer}.mlp.experts.{e}.{_HUB_EXPERTS[suffix]}.weight"] = expert
        else:
            raise ModelFormatError(f"tensor {key!r} is not part of a DBRX checkpoint")
    return out


def hf_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """A folder's weights (the loader's Weights) under llmrun's names (hub_tensors)."""
    renamed = hub_tensors({k: w.tensor for k, w in weights.items()}, config)
    return {k: weight_type(t) for k, t in renamed.items()}


def hf_name(gguf_name: str) -> str | None:
    """llmrun's key for a dbrx GGUF tensor (a stack of experts: with an {expert}
    field), or None."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        return None
    name = _GGUF_LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{parts[1]}.{name}.weight"


def config_from_gguf(gg: GGUFFile, rope_from_gguf: Callable[..., dict]) -> dict[str, Any]:
    """An HF-style dbrx config (ModelArgs' flat names) from a GGUF's metadata, as
    llama_model_dbrx and llama.cpp's load_hparams read it. `rope_from_gguf` is
    gguf_config's reader of the RoPE keys."""
    path = gg.path
    meta = ArchMetadata.of(gg, ARCH)
    hidden = meta.require(Keys.LLM.EMBEDDING_LENGTH)
    heads = meta.require(Keys.Attention.HEAD_COUNT)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        raise ModelFormatError(
            f"{path}: an embedding of {hidden} does not split into {heads} heads"
        )
    head_dim = hidden // heads
    key_length = meta.get(Keys.Attention.KEY_LENGTH, head_dim)
    if key_length != head_dim or meta.get(Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise UnsupportedError(
            f"{path}: heads of {key_length} features in an embedding of {hidden} with "
            f"{heads} heads; DBRX's heads are embedding / heads wide (its fused attn_qkv)"
        )
    count, used = meta.get(Keys.LLM.EXPERT_COUNT, 0), meta.get(Keys.LLM.EXPERT_USED_COUNT, 0)
    if not 0 < used <= count:
        raise ModelFormatError(
            f"{path}: {Keys.LLM.EXPERT_USED_COUNT.format(arch=ARCH)} is {used} and "
            f"{Keys.LLM.EXPERT_COUNT.format(arch=ARCH)} {count}; DBRX routes each token "
            "to 1 to expert_count experts"
        )
    if "output.weight" not in gg.tensors:
        raise ModelFormatError(
            f"{path}: tensor 'output.weight' is missing; DBRX has an output matrix of its own"
        )
    context = meta.require(Keys.LLM.CONTEXT_LENGTH)

    rope = rope_from_gguf(gg, meta, head_dim, context)
    if "partial_rotary_factor" in rope:
        raise UnsupportedError(
            f"{path}: {Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)} is not the head size "
            f"{head_dim}; DBRX rotates whole heads"
        )
    clamp = meta.require(Keys.Attention.CLAMP_KQV)
    tokens = gg.metadata.get(Keys.Tokenizer.LIST)
    embed = gg.tensors.get("token_embd.weight")
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": meta.require(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": meta.require(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(Keys.Attention.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "vocab_size": (len(tokens) if tokens else None) or (embed.shape[0] if embed else None),
        "clip_qkv": clamp if clamp > 0 else None,  # llama.cpp clamps where it is over 0
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "moe_normalize_expert_weights": 1.0,
        "layer_norm_eps": meta.require(Keys.Attention.LAYERNORM_EPS),
        "tie_word_embeddings": False,
        "rope_parameters": rope,
    }
