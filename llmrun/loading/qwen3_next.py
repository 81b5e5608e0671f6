"""Qwen3-Next at the loader edge: Hugging Face folders, and GGUFs of llama.cpp's arch
"qwen3next" as its converter writes them (conversion/qwen.py Qwen3NextModel), read as
src/models/qwen3next.cpp reads them. Both are turned into the projections the model takes
(llmrun.models.qwen3_next): Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.

A checkpoint's in_proj_qkvz holds per key head [query, key, its value heads' values, their
gates] and in_proj_ba per key head [its value heads' betas, their decays]; the converter
already splits in_proj_qkvz into attn_qkv ([all queries, all keys, all values]) and
attn_gate, but keeps in_proj_ba as ssm_ba. Splitting moves whole rows, so it works on
GGML blocks too. The other conversions are Qwen3.5's (llmrun.loading.qwen35: norms as
1 + w, A_log as -exp(A_log), dt_bias, the squeezed convolution, MTP layers skipped);
the value heads stay grouped by key head (llama.cpp's graph repeats each key head in
place). Files of the older form, with the fused ssm_in, are refused.
"""

from __future__ import annotations

from typing import Any

from llmrun.errors import ModelFormatError

ARCH = "qwen3next"
MODEL_TYPE = "qwen3_next"
_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"


def _heads(config: dict[str, Any]) -> tuple[int, int]:
    """Key heads, and value heads per key head."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if not k_heads or v_heads % k_heads:
        raise ModelFormatError(
            f"linear_num_value_heads ({v_heads}) is not a multiple of linear_num_key_heads "
            f"({k_heads})"
        )
    return k_heads, v_heads // k_heads


def split_qkvz(tensor: Any, config: dict[str, Any]) -> tuple[Any, Any]:
    """in_proj_qkvz's rows [per key head: q, k, v, z] as in_proj_qkv [all q, all k, all v]
    and in_proj_z."""
    import torch

    k_heads, per = _heads(config)
    kd, vd = config["linear_key_head_dim"], config["linear_value_head_dim"]
    cols = tensor.shape[-1]
    if tensor.shape[0] != k_heads * (2 * kd + 2 * per * vd):
        raise ModelFormatError(
            f"in_proj_qkvz has {tensor.shape[0]} rows; the config implies "
            f"{k_heads * (2 * kd + 2 * per * vd)}"
        )
    grouped = tensor.reshape(k_heads, -1, cols)  # [key heads, q + k + v + z rows, cols]
    q, k, v, z = grouped.split([kd, kd, per * vd, per * vd], dim=1)
    qkv = torch.cat([part.reshape(-1, cols) for part in (q, k, v)])
    return qkv, z.reshape(-1, cols)


def split_ba(tensor: Any, config: dict[str, Any]) -> tuple[Any, Any]:
    """in_proj_ba's rows [per key head: its betas, its decays] as in_proj_b and in_proj_a
    (value heads in order)."""
    k_heads, per = _heads(config)
    if tensor.shape[0] != 2 * k_heads * per:
        raise ModelFormatError(
            f"in_proj_ba has {tensor.shape[0]} rows; the config implies {2 * k_heads * per}"
        )
    grouped = tensor.reshape(k_heads, 2, per, tensor.shape[-1])
    return grouped[:, 0].reshape(k_heads * per, -1), grouped[:, 1].reshape(k_heads * per, -1)


def split_weights(weights: dict[str, Any], config: dict[str, Any], weight_type: type) -> dict:
    """Each layer's in_proj_qkvz and in_proj_ba (float, or rows of GGML blocks) as the
    model's four projections. `weight_type` is the loader's Weight."""
    hidden = config["hidden_size"]
    out = {}
    for name, w in weights.items():
        layer = name.removesuffix(_QKVZ).removesuffix(_BA)
        if name.endswith(_QKVZ):
            qkv, z = split_qkvz(w.tensor, config)
            out[layer + "linear_attn.in_proj_qkv.weight"] = _rows(qkv, w, hidden, weight_type)
            out[layer + "linear_attn.in_proj_z.weight"] = _rows(z, w, hidden, weight_type)
        elif name.endswith(_BA):
            b, a = split_ba(w.tensor, config)
            out[layer + "linear_attn.in_proj_b.weight"] = _rows(b, w, hidden, weight_type)
            out[layer + "linear_attn.in_proj_a.weight"] = _rows(a, w, hidden, weight_type)
        else:
            out[name] = w
    return out


def _rows(tensor: Any, source: Any, hidden: int, weight_type: type) -> Any:
    """A Weight of some of `source`'s rows, in its storage type."""
    if source.ggml_type is None:
        return weight_type(tensor.contiguous())
    return weight_type(tensor.contiguous(), source.ggml_type, (tensor.shape[0], hidden))
