"""Molmo 2's language model weights as its checkpoints hold them (AI2's names, which
transformers' save_pretrained writes back) -> llmrun.models.molmo2_text's: the fused
att_proj cut into q/k/v (views), ff_proj into its up and gate halves (transformers'
conversion_mapping "molmo2"), wte's embedding and new_embedding kept as the model's two
tables, however the checkpoint cut its rows between them (AI2's: the base vocabulary and
the image tokens; transformers' save_pretrained: two halves).
"""

from __future__ import annotations

from typing import Any

import torch

from llmrun.errors import ModelFormatError

MODEL_TYPE = "molmo2_text"
_TOP = "model.transformer."
# AI2's names in a block -> llmrun's (the fused ones are cut below).
_BLOCK_NAMES = {
    "attn_norm.": "input_layernorm.",
    "ff_norm.": "post_attention_layernorm.",
    "self_attn.attn_out.": "self_attn.o_proj.",
    "self_attn.q_norm.": "self_attn.q_norm.",
    "self_attn.k_norm.": "self_attn.k_norm.",
    "mlp.ff_out.": "mlp.down_proj.",
}
# The two embedding tables -> the model's (llmrun.models.molmo2_text.TwoTableEmbedding).
_TABLES = {
    "wte.embedding": "model.embed_tokens.embedding.weight",
    "wte.new_embedding": "model.embed_tokens.new_embedding.weight",
}


def hf_checkpoint(
    config: dict[str, Any], weights: dict[str, Any], weight: type
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config with the first embedding table's rows (embedding_rows) and the language
    model's weights under llmrun's names (`weight`: the loader's Weight)."""
    heads, dim = config["num_attention_heads"], _head_dim(config)
    kv_heads = config.get("num_key_value_heads") or heads
    qkv = (heads * dim, kv_heads * dim, kv_heads * dim)
    out, tables = {}, {}
    for name, w in weights.items():
        if not name.startswith(_TOP):
            out[name] = w
            continue
        rest = name[len(_TOP) :]
        if rest in _TABLES:
            tables[rest] = w
        elif rest.startswith("ln_f."):
            out["model.norm." + rest[len("ln_f.") :]] = w
        elif rest.startswith("blocks."):
            out.update(_block(name, rest[len("blocks.") :], w, qkv, weight))
        else:
            raise ModelFormatError(f"tensor {name}: not one of Molmo 2's language model")
    if sorted(tables) != sorted(_TABLES):
        raise ModelFormatError("Molmo 2 weights without wte.embedding and wte.new_embedding")
    if "lm_head.weight" not in out:
        raise ModelFormatError("Molmo 2 weights without lm_head.weight (it ties no head)")
    for name, new in _TABLES.items():
        out[new] = tables[name]
    return {**config, "embedding_rows": tables["wte.embedding"].shape[0]}, out


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _block(name: str, rest: str, w: Any, qkv: tuple[int, int, int], weight: type) -> dict[str, Any]:
    layer, _, param = rest.partition(".")
    prefix = f"model.layers.{layer}."
    if param.startswith("self_attn.att_proj."):
        kind = param.rpartition(".")[2]
        if w.shape[0] != sum(qkv):
            raise ModelFormatError(
                f"tensor {name} has {w.shape[0]} rows, not the {sum(qkv)} of q, k and v"
            )
        parts = torch.split(w.tensor, qkv)
        return {
            f"{prefix}self_attn.{p}_proj.{kind}": weight(t)
            for p, t in zip("qkv", parts, strict=True)
        }
    if param.startswith("mlp.ff_proj."):
        kind = param.rpartition(".")[2]
        up, gate = w.tensor.chunk(2)
        return {
            f"{prefix}mlp.up_proj.{kind}": weight(up),
            f"{prefix}mlp.gate_proj.{kind}": weight(gate),
        }
    for old, new in _BLOCK_NAMES.items():
        if param.startswith(old):
            return {prefix + new + param[len(old) :]: w}
    raise ModelFormatError(f"tensor {name}: not one of Molmo 2's language model")
