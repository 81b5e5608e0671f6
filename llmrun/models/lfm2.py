"""LFM2 (Liquid AI's LFM2-350M ... 2.6B and LFM2.5): a hybrid of gated short
convolutions and attention. Most layers are convolution blocks: in_proj splits into
B, C and x; B * x goes through a causal depthwise convolution of conv_L_cache taps
(its last conv_L_cache - 1 inputs are the state a sequence carries from one forward to
the next); C gates its output; out_proj. The others (config layer_types, or the older
full_attn_idxs) are attention with an RMSNorm on each query and key head. Every layer
has a SwiGLU feed-forward; the final norm is called embedding_norm.

Reference: transformers/models/lfm2/modeling_lfm2.py. Parameter names are Hugging
Face checkpoint keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    CausalLM,
    Frame,
    Hybrid,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend,
)
from llmrun.models.cache import KVCache

LAYER_TYPES = ("full_attention", "conv")


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    norm_eps: float = 1e-5
    max_position_embeddings: int = 128_000
    conv_L_cache: int = 3
    conv_bias: bool = False
    block_auto_adjust_ff_dim: bool = True
    block_ffn_dim_multiplier: float | None = 1.0
    block_multiple_of: int = 256
    full_attn_idxs: list[int] | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            # transformers' default without either list: every layer attends.
            attending = self.full_attn_idxs
            if attending is None:
                attending = range(self.num_hidden_layers)
            self.layer_types = [
                "full_attention" if i in attending else "conv"
                for i in range(self.num_hidden_layers)
            ]
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise UnsupportedError(
                    f"LFM2 layer type {kind!r} is not supported (supported: "
                    f"{', '.join(LAYER_TYPES)})"
                )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if self.conv_L_cache < 2:
            raise ModelFormatError(f"conv_L_cache is {self.conv_L_cache}; LFM2 needs 2 or more")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        # Older LFM2 config.json files name two fields otherwise (as Lfm2Config reads them).
        aliases = {"block_ff_dim": "intermediate_size", "tie_embedding": "tie_word_embeddings"}
        config = {**config, **{new: config[old] for old, new in aliases.items() if old in config}}
        return args_from_config(cls, config)

    @property
    def attention_layers(self) -> list[int]:
        """The attention layers' indices; the KV cache holds these alone, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    @property
    def feed_forward_width(self) -> int:
        """The SwiGLU's width: intermediate_size, or with block_auto_adjust_ff_dim two
        thirds of it, times the multiplier, rounded up to block_multiple_of."""
        width = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            width = int(2 * width / 3)
            if self.block_ffn_dim_multiplier is not None:
                width = int(self.block_ffn_dim_multiplier * width)
                width = -(-width // self.block_multiple_of) * self.block_multiple_of
        return width

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each convolution layer's state of one sequence: its last conv_L_cache - 1
        inputs [hidden, conv_L_cache - 1]."""
        return {
            i: [(self.hidden_size, self.conv_L_cache - 1)]
            for i, kind in enumerate(self.layer_types)
            if kind == "conv"
        }

    def layer_windows(self) -> list[None]:
        """Each cached (attention) layer's window: none (llmrun.models.kv_cache_bytes)."""
        return [None] * len(self.attention_layers)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.cache_layer = args.attention_layers.index(layer)
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, args.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = frame.rotate(self.q_layernorm(q).transpose(1, 2))
        k = frame.rotate(self.k_layernorm(k).transpose(1, 2))
        return self.out_proj(attend(q, k, v, self.cache_layer, frame, cache))


class ShortConv(nn.Module):
    """out_proj(C * conv(B * x)), the convolution causal and depthwise, over the
    sequence's last conv_L_cache - 1 inputs (the state, zeros at position 0) and this
    forward's."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        hidden, taps = args.hidden_size, args.conv_L_cache
        self.conv = nn.Conv1d(hidden, hidden, taps, groups=hidden, bias=args.conv_bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=args.conv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=args.conv_bias)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        inputs = (b * h).transpose(1, 2)  # [B, T, hidden] -> [B, hidden, T]
        kept = self.conv.kernel_size[0] - 1
        if cache is None:
            past = inputs.new_zeros(*inputs.shape[:2], kept)
        else:
            if cache.recurrent is None:
                raise RuntimeError(
                    "LFM2's convolutions need a cache with their state (the model's new_cache)"
                )
            (past,) = cache.recurrent.read(self.layer)
        window = torch.cat((past.to(inputs.dtype), inputs), dim=-1)  # [B, hidden, kept + T]
        if cache is not None:
            # Each row's state: the last `kept` inputs up to its last real token, so the
            # padding of a shorter row never enters it.
            starts = frame.counts.to(window.device)[:, None] + torch.arange(
                kept, device=window.device
            )
            state = window.gather(2, starts[:, None, :].expand(-1, window.shape[1], -1))
            cache.recurrent.write(self.layer, [state.float()])
        out = F.conv1d(window, self.conv.weight, self.conv.bias, groups=window.shape[1])
        return self.out_proj(c * out.transpose(1, 2))


class MLP(nn.Module):
    """w2(silu(w1(x)) * w3(x)) of a given width: the dense feed-forward, or an expert."""

    def __init__(self, args: ModelArgs, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, width, bias=False)
        self.w3 = nn.Linear(args.hidden_size, width, bias=False)
        self.w2 = nn.Linear(width, args.hidden_size, bias=False)
        self.act = F.silu  # read by llmrun.quant.experts, which runs the experts fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.gated(self.act, self.w1(x), self.w3(x)))


def dense_feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    return MLP(args, args.feed_forward_width)


class DecoderLayer(nn.Module):
    """x + operator(operator_norm(x)), then x + feed_forward(ffn_norm(x)); the operator
    is the layer type's: a convolution block or attention."""

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        attention: type,
        feed_forward: Callable[[ModelArgs, int], nn.Module],
    ) -> None:
        super().__init__()
        if args.layer_types[layer] == "conv":
            self.conv = ShortConv(args, layer)
        else:
            self.self_attn = attention(args, layer)
        self.feed_forward = feed_forward(args, layer)
        self.operator_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        operator = self.conv if hasattr(self, "conv") else self.self_attn
        x = x + operator(self.operator_norm(x), frame, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Body(nn.Module):
    """The embedding, the layers, the final norm under its Hugging Face name
    (embedding_norm) and the RoPE tables."""

    def __init__(
        self,
        args: ModelArgs,
        attention: type,
        feed_forward: Callable[[ModelArgs, int], nn.Module],
        layer: type,
        norm: nn.Module | None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, feed_forward) for i in range(args.num_hidden_layers)
        )
        self.embedding_norm = norm if norm is not None else RMSNorm(args.hidden_size, args.norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )

    @property
    def norm(self) -> nn.Module:
        """The final norm, under the name llmrun.models.base.head_logits reads."""
        return self.embedding_norm


class Model(Hybrid, CausalLM):
    def __init__(
        self,
        args: ModelArgs,
        feed_forward: Callable[[ModelArgs, int], nn.Module] = dense_feed_forward,
    ) -> None:
        super().__init__(args, Attention, feed_forward, DecoderLayer, body=Body)
