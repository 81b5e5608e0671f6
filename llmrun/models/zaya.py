"""ZAYA1 (Zyphra): attention through Compressed Convolutional Attention (CCA) and a
mixture of experts with a recurrent router, every layer both ("hybrid", or
"hybrid_sliding" with a sliding window).

CCA: the queries and keys of q_proj and k_proj go through a causal convolution over the
sequence (a depthwise one of cca_time0 taps, then one of cca_time1 taps mixing each
head's features), plus residuals (each query head averaged with its key head, each key
head the mean of its query heads' averages); the values are half this token's
v_proj_current and half the previous token's v_proj_delayed (of one flat vector cut into
heads). Queries and keys are then scaled to a norm of sqrt(head_dim), the keys times a
learned temperature per KV head, and turned by a partial RoPE (half of each head by
default) of each layer type's base. What a sequence carries from token to token beside
its keys and values (llmrun.models.recurrent) is each layer's last cca_time0 + cca_time1
- 2 convolution inputs and the previous token's delayed values.

Each token goes to one of num_experts experts or to none (a skip class, the last of the
router's): a router MLP (down to router_hidden_size, the previous layer's router state
added times a learned scale from the second layer on, RMSNorm, two GELU layers, logits)
chooses by softmax + balancing_biases and weighs by the softmax. The residual stream is
mixed as (out + b) * s + (residual + b') * s' after each sublayer, and the embeddings
enter it as (x + b) * s.

Reference: transformers/models/zaya/modeling_zaya.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    Frame,
    RMSNorm,
    RotaryEmbedding,
    args_from_config,
    attend_scaled,
    layer_frames,
    mix_experts,
    rope_parameters,
)
from llmrun.models.cache import KVCache
from llmrun.models.qwen3_moe import MLP
from llmrun.models.recurrent import RecurrentState

HYBRID, SLIDING = "hybrid", "hybrid_sliding"
# ZayaConfig's RoPE of each layer type where a config gives none.
DEFAULT_ROPE = {
    HYBRID: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
}
# llmrun's frames (base.layer_frames) by layer type.
FRAMES = {HYBRID: "full_attention", SLIDING: "sliding_attention"}


@dataclass
class ModelArgs:
    # ZayaConfig's defaults.
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    sliding_window: int | None = None
    attention_bias: bool = False
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 1
    num_experts: int = 16
    layer_types: list[str] | None = None
    lm_head_bias: bool = False
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # "hybrid" layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # "hybrid_sliding"

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [HYBRID] * self.num_hidden_layers
        unknown = sorted(set(self.layer_types) - {HYBRID, SLIDING})
        if unknown:
            raise UnsupportedError(
                f"ZAYA layer type {unknown[0]!r} is not supported (supported: {HYBRID}, {SLIDING})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types lists {len(self.layer_types)} layers, but num_hidden_layers "
                f"is {self.num_hidden_layers}"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelFormatError("ZAYA's hybrid_sliding layers need a sliding_window")
        if self.num_experts_per_tok != 1:
            raise UnsupportedError(
                f"ZAYA with num_experts_per_tok {self.num_experts_per_tok} is not supported "
                "(1, as transformers computes it)"
            )
        if self.lm_head_bias and self.tie_word_embeddings:
            # The loader's tied head (llmrun.quant.linear.tied_head) has no bias.
            raise UnsupportedError("ZAYA with lm_head_bias and tied embeddings is not supported")
        if self.attention_bias:
            # Its delayed values at position 0 would be the bias, not the state's zeros.
            raise UnsupportedError("ZAYA with attention_bias=true is not supported")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ModelFormatError(
                "ZAYA needs query heads in whole groups per KV head and an even head_dim"
            )
        if self.cca_time0 < 1 or self.cca_time1 < 1:
            raise ModelFormatError("ZAYA's cca_time0 and cca_time1 must be at least 1")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        nested = dict(config.get("rope_parameters") or {})
        # The Hub's config.json also has a top-level rope_type beside the nested ones,
        # which ZayaConfig drops (convert_rope_params_to_dict).
        ropes = {
            kind: rope_parameters({"rope_parameters": {**default, **(nested.get(kind) or {})}})
            for kind, default in DEFAULT_ROPE.items()
        }
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat, nullable=("sliding_window",))
        args.rope_parameters, args.rope_local_parameters = ropes[HYBRID], ropes[SLIDING]
        return args

    @property
    def conv_taps(self) -> int:
        """The earlier inputs the two convolutions reach back to."""
        return self.cca_time0 - 1 + self.cca_time1 - 1

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window, None for the hybrid (global) ones."""
        return [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """Each layer's state of one sequence: its last conv_taps convolution inputs
        [(heads + KV heads) * head_dim, conv_taps] and the previous token's delayed
        values [KV heads * head_dim / 2]."""
        width = (self.num_attention_heads + self.num_key_value_heads) * self.head_dim
        values = self.num_key_value_heads * self.head_dim // 2
        return {i: [(width, self.conv_taps), (values,)] for i in range(self.num_hidden_layers)}


class Projections(nn.Module):
    """CCA's queries, keys and values (the module docstring)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim, self.taps = args.head_dim, args.conv_taps
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        hidden, channels = args.hidden_size, q_width + kv_width
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj_current = nn.Linear(hidden, kv_width // 2, bias=False)
        self.v_proj_delayed = nn.Linear(hidden, kv_width // 2, bias=False)
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, args.cca_time0, groups=channels)
        groups = self.n_heads + self.n_kv_heads
        self.conv_qk_grouped = nn.Conv1d(channels, channels, args.cca_time1, groups=groups)

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> queries [B, T, H, D], keys and values [B, T, Hkv, D]."""
        batch, tokens, _ = x.shape
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)
        inputs = torch.cat((q, k), dim=-1).transpose(1, 2)  # [B, channels, T]
        delayed = self.v_proj_delayed(x)
        if cache is None:
            past = inputs.new_zeros(batch, inputs.shape[1], self.taps)
            previous = delayed.new_zeros(batch, 1, delayed.shape[-1])
        else:
            if cache.recurrent is None:
                raise RuntimeError("ZAYA needs a cache with its state (the model's new_cache)")
            past, previous = cache.recurrent.read(self.layer)
            past, previous = past.to(inputs.dtype), previous.to(delayed.dtype)[:, None]
        window = torch.cat((past, inputs), dim=-1)  # [B, channels, taps + T]
        # Half of the flat values from this token, half from the one before it (read
        # before the state below is overwritten in place).
        shifted = torch.cat((previous, delayed[:, :-1]), dim=1)
        if cache is not None:
            # Each row's state after its last real token: the padding never enters it.
            counts = frame.counts.to(window.device)
            taps = counts[:, None] + torch.arange(self.taps, device=window.device)
            kept = window.gather(2, taps[:, None, :].expand(-1, window.shape[1], -1))
            last = delayed[torch.arange(batch, device=x.device), counts - 1]
            cache.recurrent.write(self.layer, [kept.float(), last.float()])
        mixed = self.conv_qk_grouped(self.conv_qk_depthwise(window)).transpose(1, 2)
        # Residuals: each query head averaged with its key head; each key head the mean
        # of its query heads' averages. [B, T, H, D] and [B, T, Hkv, D]
        groups = heads // kv_heads
        q_res = q.view(batch, tokens, heads, dim)
        q_res = (q_res + k.view(batch, tokens, kv_heads, dim).repeat_interleave(groups, 2)) / 2
        k_res = q_res.view(batch, tokens, kv_heads, groups, dim).mean(dim=-2)
        query = mixed[..., : heads * dim].view(batch, tokens, heads, dim) + q_res
        key = mixed[..., heads * dim :].view(batch, tokens, kv_heads, dim) + k_res
        value = torch.cat((self.v_proj_current(x), shifted), dim=-1)
        return query, key, value.view(batch, tokens, kv_heads, dim)


class QKNorm(nn.Module):
    """Queries and keys to a norm of sqrt(head_dim), the keys times `temp` per KV head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.scale = args.head_dim**0.5
        self.temp = nn.Parameter(torch.zeros(args.num_key_value_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, None, :, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.frame_kind = layer, FRAMES[args.layer_types[layer]]
        self.scale = args.head_dim**-0.5
        self.qkv_proj = Projections(args, layer)
        self.qk_norm = QKNorm(args)
        width = args.num_attention_heads * args.head_dim
        self.o_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None
    ) -> torch.Tensor:
        frame = frames[self.frame_kind]
        q, k, v = self.qkv_proj(x, frame, cache)
        q, k = self.qk_norm(q, k)
        # [B, T, H, D] -> [B, H, T, D]
        q, k = frame.rotate(q.transpose(1, 2)), frame.rotate(k.transpose(1, 2))
        out = attend_scaled(q, k, v.transpose(1, 2), self.layer, frame, cache, self.scale)
        return self.o_proj(out)


class RouterMLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.router_hidden_size
        self.norm = RMSNorm(width, args.rms_norm_eps)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, args.num_experts + 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class Router(nn.Module):
    """Each token's expert (or none: the skip class) and its weight, and the router state
    the next layer adds to its own."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.skip = args.num_experts
        self.down_proj = nn.Linear(args.hidden_size, args.router_hidden_size)
        self.takes_state = layer > 0  # the first layer's has no scale: no state comes in
        if self.takes_state:
            self.router_states_scale = nn.Parameter(torch.ones(args.router_hidden_size))
        self.router_mlp = RouterMLP(args)
        self.balancing_biases = nn.Parameter(torch.zeros(args.num_experts + 1))

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, 1], expert indices [N, 1], the router state [N, R]."""
        hidden = self.down_proj(x)
        if state is not None and self.takes_state:
            hidden = hidden + state * self.router_states_scale
        probs = torch.softmax(self.router_mlp(hidden), dim=-1)
        indices = torch.topk(probs.float() + self.balancing_biases.float(), 1).indices
        weights = probs.gather(1, indices)
        skipped = indices == self.skip  # weighed 0 on expert 0, as transformers does
        return weights.masked_fill(skipped, 0), indices.masked_fill(skipped, 0), hidden


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.gate = Router(args, layer)
        self.experts = nn.ModuleList(
            MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = x.reshape(-1, x.shape[-1])  # [B, T, D] -> [B*T, D]
        weights, indices, state = self.gate(x2, state)
        return mix_experts(x2, weights, indices, self.experts).view(x.shape), state


class ResidualScaling(nn.Module):
    """(out + b) * s + (residual + b') * s'."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(dim))
        self.hidden_states_bias = nn.Parameter(torch.zeros(dim))
        self.residual_scale = nn.Parameter(torch.ones(dim))
        self.residual_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (out + self.hidden_states_bias) * self.hidden_states_scale + (
            residual + self.residual_bias
        ) * self.residual_scale


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MoE(args, layer)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.post_attention_residual_scale = ResidualScaling(dim)
        self.post_mlp_residual_scale = ResidualScaling(dim)

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.post_attention_residual_scale(
            self.self_attn(self.input_layernorm(x), frames, cache), x
        )
        out, state = self.mlp(self.post_attention_layernorm(x), state)
        return self.post_mlp_residual_scale(out, x), state


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.input_hidden_states_scale = nn.Parameter(torch.ones(args.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        positions = args.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim, positions)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, positions
        )


class Model(nn.Module):
    """embed -> (x + b) * s -> layers (the router state passed along) -> norm -> lm_head,
    with transformers' module names."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.lm_head_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] (or [B, 1, vocab]: last_only, or `last` [B], each
        row's last real token) of input_ids [B, T] at positions [B, T]."""
        if static is not None:
            raise UnsupportedError("ZAYA has no static decode step (CUDA graphs)")
        body = self.model
        x = (body.embed_tokens(input_ids) + body.input_hidden_states_bias) * (
            body.input_hidden_states_scale
        )
        frames = self.frame(positions, cache, x.dtype, last)
        state = None
        for layer in body.layers:
            x, state = layer(x, frames, cache, state)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(body.norm(x)).float()

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type (layer_frames), each with the rows' real token counts
        where the cache carries the recurrent state (RecurrentState.begin, once)."""
        body = self.model
        frames = layer_frames(
            positions, cache, dtype, self.args.sliding_window, body.rotary_emb,
            body.rotary_emb_local, last,
        )  # fmt: skip
        if cache is not None and cache.recurrent is not None:
            counts = cache.recurrent.begin(positions)
            for frame in frames.values():
                frame.counts = counts
        return frames

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        cache = KVCache(
            args.num_hidden_layers, batch, args.num_key_value_heads, max_seq_len,
            args.head_dim, dtype, device, windows=args.layer_windows(),
        )  # fmt: skip
        cache.recurrent = RecurrentState(args.recurrent_shapes(), batch, torch.float32, device)
        return cache
