"""CodeGen at the loader edge: the Hub's checkpoints (Salesforce/codegen-*: GPT-J's
transformer.wte, h.N, ln_f with one fused attn.qkv_proj) under llmrun's GPT-J names
(llmrun/models/gptj.py runs the model). llama.cpp has no converter for CodeGen, so there
is no GGUF to read.

CodeGen was trained on 4 model-parallel shards, and qkv_proj's rows keep their order:
4 groups, each of a quarter of the queries, then a quarter of the values, then a quarter
of the keys (transformers' CodeGenAttention hard-codes mp_num = 4). CodeGen2's folders
run remote code of their own (auto_map), trained on another number of shards (8, as
reported; transformers' CodeGen does not follow it): those are refused rather than run
with a split that may be wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gpt2

MODEL_TYPE = "codegen"
MP_NUM = 4
# Each shard's thirds of qkv_proj's rows, in order.
_ORDER = ("q_proj", "v_proj", "k_proj")
# The attention's mask buffers older checkpoints carry: not weights.
_BUFFERS = (".attn.causal_mask", ".attn.masked_bias")


def _check_config(config: dict[str, Any], path: Path) -> None:
    """Refuse CodeGen2's remote-code folders and hidden sizes the 4 shards cannot split."""
    if "auto_map" in config:
        raise UnsupportedError(
            f"{path}: this CodeGen folder runs remote code of its own (auto_map, as "
            "CodeGen2's do), whose qkv_proj split transformers' CodeGen (4 shards) does not "
            "follow; it is not supported"
        )
    hidden = config.get("n_embd", config.get("hidden_size"))
    if not isinstance(hidden, int) or hidden % MP_NUM:
        raise UnsupportedError(
            f"{path}: a CodeGen model of hidden size {hidden} is not supported "
            f"(its qkv_proj is split over {MP_NUM} shards)"
        )


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Path, weight_type: type
) -> dict:
    """A Hub checkpoint's tensors under llmrun's GPT-J names: each fused qkv_proj split
    into q_proj, k_proj and v_proj, the mask buffers dropped. Refuses CodeGen2's remote
    code and hidden sizes the shards cannot split."""
    _check_config(config, path)
    out = {}
    for name, w in gpt2.hf_weights(weights, weight_type).items():
        if name.endswith(_BUFFERS):
            continue
        if not name.endswith(".attn.qkv_proj.weight"):
            out[name] = w
            continue
        rows, columns = w.tensor.shape
        if rows != 3 * columns:
            raise ModelFormatError(
                f"{path}: {name} is {rows} x {columns}, not 3 x hidden rows by hidden columns"
            )
        # [3 * hidden, hidden] -> [shard, (q, v, k), hidden / shards, hidden]
        shards = w.tensor.reshape(MP_NUM, 3, rows // (3 * MP_NUM), columns)
        prefix = name.removesuffix("qkv_proj.weight")
        for part, projection in enumerate(_ORDER):
            split = shards[:, part].reshape(rows // 3, columns).contiguous()
            out[f"{prefix}{projection}.weight"] = weight_type(split)
    return out
