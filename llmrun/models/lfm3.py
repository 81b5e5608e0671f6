"""LFM3 (Liquid AI's LFM3-1.7B): LFM2's hybrid of gated short convolutions and
attention, with three differences. Attention layers are "full_attention" or
"sliding_attention" (the last sliding_window positions), each type with its own RoPE
(by default the full layers' "proportional": the first half of the frequencies of a
full-width rotation turn, the rest stand still; the sliding layers' plain); their
queries and keys are Qwen 3's, RMS-normed per head, and with use_attention_gate each
head's output is scaled by sigmoid(gate_proj(x)) (the Hub's key; transformers
renames it g_proj). With use_sandwich_norm every operator's
and feed-forward's output is RMS-normed before it joins the residual stream. The
feed-forward is a SwiGLU of intermediate_size (no width adjustment).

llama.cpp has no "lfm3" arch: Hugging Face folders only.

Reference: transformers/models/lfm3/modeling_lfm3.py. Parameter names are Hugging
Face checkpoint keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import lfm2
from llmrun.models.base import (
    Frame,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend,
    layer_frames,
)
from llmrun.models.cache import KVCache
from llmrun.models.gemma4 import proportional_rope

FULL, SLIDING, CONV = "full_attention", "sliding_attention", "conv"
ATTENTION_TYPES = (FULL, SLIDING)
# Lfm3Config's RoPE where a config.json has none.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}


@dataclass
class ModelArgs(lfm2.ModelArgs):
    # Lfm3Config's defaults where they differ from LFM2's.
    conv_L_cache: int = 7
    head_dim: int | None = 128
    sliding_window: int | None = 256
    use_sandwich_norm: bool = True
    use_attention_gate: bool = True
    attention_bias: bool = False
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        if self.layer_types is None:
            # Lfm3Config's pattern: every fourth layer from 2 full, from 4 sliding.
            self.layer_types = [
                FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else CONV
                for i in range(self.num_hidden_layers)
            ]
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING, CONV})
        if unknown:
            raise UnsupportedError(
                f"LFM3 layer types {unknown} are not supported (supported: {FULL}, "
                f"{SLIDING}, {CONV})"
            )
        if self.attention_bias:
            raise UnsupportedError("LFM3 with attention_bias is not supported")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelFormatError("LFM3 sliding_attention layers need a sliding_window")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if self.conv_L_cache < 2:
            raise ModelFormatError(f"conv_L_cache is {self.conv_L_cache}; LFM3 needs 2 or more")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat)
        args.rope_parameters, args.rope_local_parameters = rope_by_layer_type(config, args.head_dim)
        return args

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices, full and sliding; the KV cache holds these alone."""
        return [i for i, kind in enumerate(self.layer_types) if kind in ATTENTION_TYPES]

    @property
    def feed_forward_width(self) -> int:
        """The SwiGLU's width: intermediate_size as given (LFM3 adjusts nothing)."""
        return self.intermediate_size


def rope_by_layer_type(config: dict[str, Any], head_dim: int) -> tuple[dict, dict]:
    """The full and the sliding layers' RoPE as RotaryEmbedding takes them, from
    config.json's rope_parameters {full_attention: {...}, sliding_attention: {...}}
    (Lfm3Config's DEFAULT_ROPE where it has none)."""
    given = config.get("rope_parameters") or DEFAULT_ROPE
    if not set(given) <= set(ATTENTION_TYPES):
        raise UnsupportedError(
            "LFM3 rope_parameters must be given per layer type (full_attention, "
            f"sliding_attention); got keys {sorted(given)}"
        )
    full = {**DEFAULT_ROPE[FULL], **(given.get(FULL) or {})}
    sliding = {**DEFAULT_ROPE[SLIDING], **(given.get(SLIDING) or {})}
    for kind, params, allowed in (
        (FULL, full, ("default", "proportional")),
        (SLIDING, sliding, ("default",)),
    ):
        if params.get("rope_type", "default") not in allowed:
            raise UnsupportedError(
                f"LFM3 {kind} RoPE type {params['rope_type']!r} is not supported "
                f"({', '.join(allowed)})"
            )
    if "partial_rotary_factor" in sliding:
        raise UnsupportedError(
            "LFM3 sliding_attention RoPE with partial_rotary_factor is not supported"
        )
    return proportional_rope(full, head_dim), {
        "rope_type": "default",
        "rope_theta": sliding["rope_theta"],
    }


class Attention(nn.Module):
    """Qwen 3's attention (q/k RMS-normed per head) of one layer type, each head's
    output scaled by sigmoid(gate_proj(x)) with use_attention_gate."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer_type = args.layer_types[layer]
        self.cache_layer = args.attention_layers.index(layer)
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        if args.use_attention_gate:
            self.gate_proj = nn.Linear(hidden, self.n_heads, bias=False)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.layer_type]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = frame.rotate(self.q_norm(q).transpose(1, 2))
        k = frame.rotate(self.k_norm(k).transpose(1, 2))
        out = attend(q, k, v, self.cache_layer, frame, cache)  # [B, T, H*D]
        if hasattr(self, "gate_proj"):
            gate = torch.sigmoid(self.gate_proj(x))  # [B, T, H], one per head
            out = (out.view(batch, tokens, self.n_heads, -1) * gate[..., None]).flatten(2)
        return self.o_proj(out)


class DecoderLayer(lfm2.DecoderLayer):
    """LFM2's layer, with use_sandwich_norm the operator's and the feed-forward's
    outputs RMS-normed (post_operator_norm, post_ffn_norm) before the residual add."""

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        attention: type,
        feed_forward: Callable[[ModelArgs, int], nn.Module],
    ) -> None:
        super().__init__(args, layer, attention, feed_forward)
        self.layer_type = args.layer_types[layer]
        if args.use_sandwich_norm:
            self.post_operator_norm = RMSNorm(args.hidden_size, args.norm_eps)
            self.post_ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        else:
            self.post_operator_norm = self.post_ffn_norm = nn.Identity()

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        if hasattr(self, "conv"):
            operated = self.conv(self.operator_norm(x), frames[FULL], cache)
        else:
            operated = self.self_attn(self.operator_norm(x), frames, cache)
        x = x + self.post_operator_norm(operated)
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))


class Model(lfm2.Model):
    def __init__(self, args: ModelArgs) -> None:
        super(lfm2.Model, self).__init__(
            args, Attention, lfm2.dense_feed_forward, DecoderLayer, body=lfm2.Body
        )
        self.model.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, args.max_position_embeddings
        )

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per attention type (each with its RoPE; the sliding one masks keys
        beyond the window), both carrying the rows' real token counts for the
        convolutions' state (which read the full one)."""
        frames = layer_frames(
            positions,
            cache,
            dtype,
            self.args.sliding_window,
            self.model.rotary_emb,
            self.model.rotary_emb_local,
            last=last,
        )
        if cache is not None and cache.recurrent is not None:
            counts = cache.recurrent.begin(positions)
            for frame in frames.values():
                frame.counts = counts
        return frames
