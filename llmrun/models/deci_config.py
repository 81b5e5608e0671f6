"""Nemotron-NAS (DeciLM) block_configs as the checkpoints' remote code reads them,
torch-free (llmrun show sizes the KV cache from them): per layer, an attention block
that is Llama's with num_attention_heads / n_heads_in_group KV heads, a linear map
(replace_with_linear) or nothing (no_op), and a feed-forward block that is Llama's
SwiGLU of the width ffn_mult gives (_ffn_mult_to_intermediate_size), a linear map or
nothing. A no_op block has no norm either. Settings the remote code computes otherwise
(sliding windows, attention sinks, ungated or non-SiLU feed-forwards) are refused. The
model: llmrun/models/deci.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.errors import ModelFormatError, UnsupportedError

MODEL_TYPE = "nemotron-nas"
ATTENTION, MLP, LINEAR, NONE = "attention", "mlp", "linear", "none"
FFN_ROUNDING = 256  # widths round up to a multiple of this (_find_multiple)
# Fields a block config may give that leave inference as it is where they are null or
# false (sparsify: a training recipe's; the sink settings only act with sink tokens).
_ATTENTION_FIELDS = {
    "no_op",
    "replace_with_linear",
    "n_heads_in_group",
    "sparsify",
    "window_length",
    "num_sink_tokens",
    "use_prefill_window_in_sink_attention",
    "unshifted_sink",
}
# intermediate_size: llmrun's own, the width a GGUF gives (feed_forward_length) in
# place of the ffn_mult it was rounded from.
_FFN_FIELDS = {"no_op", "replace_with_linear", "ffn_mult", "sparsify", "gated", "hidden_act"}
_FFN_FIELDS |= {"intermediate_size"}


@dataclass(frozen=True)
class Block:
    """One layer: its attention (ATTENTION, LINEAR or NONE) with kv_heads KV heads (0
    unless ATTENTION), and its feed-forward (MLP, LINEAR or NONE) of intermediate_size
    (0 unless MLP)."""

    attention: str
    kv_heads: int
    ffn: str
    intermediate_size: int


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The feed-forward width of a block's ffn_mult: 2/3 of ffn_mult * hidden_size,
    truncated, then rounded up to a multiple of 256 (the remote code's and llama.cpp's
    converter's rule)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return -(-width // FFN_ROUNDING) * FFN_ROUNDING


def blocks(config: dict[str, Any]) -> list[Block]:
    """Each layer's Block from a config.json-style dict's block_configs; ModelFormatError
    where they do not describe a model, UnsupportedError where the model is one llmrun
    does not compute."""
    configs = config.get("block_configs")
    layers = config.get("num_hidden_layers")
    if not isinstance(configs, list) or len(configs) != layers:
        raise ModelFormatError(
            f"block_configs must list one block per layer ({layers}); got {configs!r:.80}"
        )
    return [_block(i, c, config) for i, c in enumerate(configs)]


def _block(layer: int, block: Any, config: dict[str, Any]) -> Block:
    attention, ffn = _part(layer, block, "attention"), _part(layer, block, "ffn")
    _check_fields(layer, "attention", attention, _ATTENTION_FIELDS)
    _check_fields(layer, "ffn", ffn, _FFN_FIELDS)
    for name in ("window_length", "num_sink_tokens"):
        if attention.get(name) is not None and not _skipped(attention):
            raise UnsupportedError(
                f"block_configs[{layer}].attention.{name} is {attention[name]!r}: "
                "sliding-window and sink attention are not supported"
            )
    if ffn.get("gated", True) is not True or ffn.get("hidden_act", "silu") != "silu":
        if not _skipped(ffn):
            raise UnsupportedError(
                f"block_configs[{layer}].ffn is {ffn!r}: only gated SiLU feed-forwards "
                "are supported"
            )
    heads = config.get("num_attention_heads")
    kind, kv_heads = _kind(attention, ATTENTION), 0
    if kind == ATTENTION:
        group = attention.get("n_heads_in_group")
        if not _positive_int(group) or not _positive_int(heads) or heads % group:
            raise ModelFormatError(
                f"block_configs[{layer}].attention.n_heads_in_group is {group!r}, which "
                f"does not divide num_attention_heads ({heads!r}) into groups"
            )
        kv_heads = heads // group
    ffn_kind, width = _kind(ffn, MLP), 0
    if ffn_kind == MLP:
        width = ffn.get("intermediate_size")
        if width is None:
            mult = ffn.get("ffn_mult")
            if not isinstance(mult, (int, float)) or isinstance(mult, bool) or mult <= 0:
                raise ModelFormatError(
                    f"block_configs[{layer}].ffn.ffn_mult is {mult!r}, not a positive number"
                )
            width = ffn_mult_to_intermediate_size(mult, config["hidden_size"])
        if not _positive_int(width):
            raise ModelFormatError(
                f"block_configs[{layer}].ffn gives a width of {width!r}, not a positive "
                "whole number"
            )
    return Block(kind, kv_heads, ffn_kind, width)


def _part(layer: int, block: Any, name: str) -> dict[str, Any]:
    part = block.get(name) if isinstance(block, dict) else None
    if not isinstance(part, dict):
        raise ModelFormatError(f"block_configs[{layer}] has no {name} object")
    return part


def _check_fields(layer: int, name: str, part: dict[str, Any], known: set[str]) -> None:
    """Refuses a setting the remote code may act on that llmrun does not know."""
    unknown = sorted(k for k, v in part.items() if k not in known and v)
    if unknown:
        raise UnsupportedError(
            f"block_configs[{layer}].{name} sets {', '.join(unknown)}, which llmrun does "
            "not support"
        )


def _skipped(part: dict[str, Any]) -> bool:
    return bool(part.get("no_op") or part.get("replace_with_linear"))


def _kind(part: dict[str, Any], own: str) -> str:
    """NONE for a no_op block, LINEAR for a linear replacement, else `own`."""
    if part.get("no_op"):
        return NONE
    return LINEAR if part.get("replace_with_linear") else own


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def head_dim(config: dict[str, Any]) -> int:
    """The head width: the config's head_dim, else hidden_size / num_attention_heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def cache_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """The (KV heads, head width) of each layer that caches keys and values (those with
    attention, in order), as llmrun.models.deci caches them."""
    width = head_dim(config)
    return [(b.kv_heads, width) for b in blocks(config) if b.attention == ATTENTION]
