"""Dory (NVIDIA Nemotron Labs Dory 1.0): a looped normalized transformer (nGPT). Its
layers are an input section run once, a recurrent section run n_recurrent_loops times
(each pass restarting from unit(state) + unit(input section's output)) and an output
section run once; every hidden state lives on the unit sphere, unit(x) = x / |x|.

A layer is Gemma 2's sandwich with unit() for every norm and a residual that moves
toward the normalized update at a learned per-channel rate: h = unit(x), then
h + |lambda_1 * alpha / s0| * (unit(attn(h)) - h), the same with lambda_2 around the MLP.
Attention is AFMoE's with nGPT's details: unit queries and keys per head, RoPE of each
layer type's own base on every layer (sliding-window layers and global ones), queries
times (sqk * sqrt(head_dim) / s0)^2 per channel after it, outputs gated by
sigmoid(gate_proj(x) * (s_gate * hidden^0.25 / s0)^2) and taken to the unit sphere
before o_proj. The MLP scales gate and up by suv * sqrt(hidden) and takes
silu(gate) * up to the unit sphere before down_proj. The logits are lm_head(unit(x)) *
logit_scale / s0 (s0: initializer_range).

The KV cache holds one entry per layer and, with recurrent_kv_cache_mode "per_loop", the
recurrent layers' again for each loop after the first (dory_config.cache_windows). With
"last_loop" the loops share the last loop's entries: an earlier loop writes its keys
where the last loop then writes its own, attending to the cached past and its own keys
as transformers' DoryPastReader gives them.

Reference: transformers/models/dory/modeling_dory.py (DoryForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import dory_config
from llmrun.models.base import (
    Frame,
    RotaryEmbedding,
    activation,
    args_from_config,
    attend_scaled,
    attention_mask,
    check_layer_types,
    key_positions,
    layer_frames,
    rope_parameters,
)
from llmrun.models.cache import KVCache

EPS = 1e-6  # DoryL2Norm's
# DoryConfig's RoPE base of each layer type where a config gives none.
DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 10_000_000.0}
# The frame of the recurrent sliding layers whose cache entries keep every position
# ("last_loop"): the window as a mask over all of them.
UNRINGED = "sliding_attention_unringed"


@dataclass
class ModelArgs:
    # DoryConfig's defaults (layer counts in layers, as DoryConfig holds them).
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_hidden_layers: int = dory_config.DEFAULT_LAYERS
    num_key_value_heads: int | None = None
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.0177
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int = dory_config.DEFAULT_WINDOW
    layer_types: list[str] | None = None
    ngpt_alpha_init: float = 0.05
    n_input_layers: int = dory_config.DEFAULT_INPUT_LAYERS
    n_recurrent_layers: int = 0
    n_output_layers: int = dory_config.DEFAULT_OUTPUT_LAYERS
    n_recurrent_loops: int = 2
    recurrent_kv_cache_mode: str = "per_loop"
    rope_parameters: dict[str, Any] = field(default_factory=dict)  # global layers
    rope_local_parameters: dict[str, Any] = field(default_factory=dict)  # sliding layers

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = dory_config.default_layer_types(self.num_hidden_layers)
        self.layer_types = check_layer_types(self.layer_types, self.num_hidden_layers)
        dory_config.check_loops(self.n_recurrent_loops, self.recurrent_kv_cache_mode)
        if self.attention_bias or self.mlp_bias:
            raise UnsupportedError("Dory with attention_bias or mlp_bias is not supported")
        if self.tie_word_embeddings:
            # The loader's tied head (llmrun.quant.linear.tied_head) has no logit_scale.
            raise UnsupportedError("Dory with tie_word_embeddings=true is not supported")
        if self.initializer_range <= 0:
            raise ModelFormatError(
                f"dory initializer_range is {self.initializer_range}; its scales divide by it"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dory_config.in_layers(config)
        nested = config.get("rope_parameters") or {}
        ropes = {
            kind: rope_parameters(
                {"rope_parameters": {"rope_theta": theta, **(nested.get(kind) or {})}}
            )
            for kind, theta in DEFAULT_THETA.items()
        }
        flat = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = args_from_config(cls, flat)
        args.rope_parameters = ropes["full_attention"]
        args.rope_local_parameters = ropes["sliding_attention"]
        return args

    @property
    def recurrent(self) -> range:
        """The recurrent section's layers."""
        return range(self.n_input_layers, self.n_input_layers + self.n_recurrent_layers)

    def layer_windows(self) -> list[int | None]:
        """Each KV cache entry's sliding window (dory_config.cache_windows)."""
        return dory_config.cache_windows(
            self.layer_types,
            self.n_input_layers,
            self.n_recurrent_layers,
            self.n_recurrent_loops,
            self.recurrent_kv_cache_mode,
            self.sliding_window,
        )

    def cache_entry(self, layer: int, loop: int) -> int:
        """The KV cache entry of `layer` in recurrent pass `loop` (0 outside the
        recurrent section): its own, or with "per_loop" one appended per later loop."""
        if loop == 0 or self.recurrent_kv_cache_mode == "last_loop":
            return layer
        offset = self.num_hidden_layers - self.n_input_layers
        return offset + (loop - 1) * self.n_recurrent_layers + layer

    def frame_kind(self, layer: int) -> str:
        """The frame `layer` attends through (UNRINGED: a recurrent sliding layer whose
        cache entries keep every position)."""
        kind = self.layer_types[layer]
        shared = self.recurrent_kv_cache_mode == "last_loop" and self.n_recurrent_loops > 1
        if kind == "sliding_attention" and shared and layer in self.recurrent:
            return UNRINGED
        return kind


def unit(x: torch.Tensor) -> torch.Tensor:
    """x / |x| along the last dimension (+ eps under the root), in float32 and cast back."""
    y = x.float()
    return (y * torch.rsqrt(y.square().sum(dim=-1, keepdim=True) + EPS)).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.sqk = nn.Parameter(torch.empty(q_width))
        self.s_gate = nn.Parameter(torch.empty(q_width))
        self.sqk_scale = self.head_dim**0.5 / args.initializer_range
        self.s_gate_scale = args.hidden_size**0.25 / args.initializer_range

    def forward(
        self, x: torch.Tensor, frame: Frame, cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], each head on the unit sphere
        q = unit(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim)).transpose(1, 2)
        k = unit(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = frame.rotate(q), frame.rotate(k.transpose(1, 2))
        # [H*D] -> [H, 1, D], one factor per query channel
        q = q * (self.sqk * self.sqk_scale).view(self.n_heads, 1, self.head_dim).square()
        out = attend_scaled(q, k, v, entry, frame, cache, self.scale)
        out = out * torch.sigmoid(self.gate_proj(x) * (self.s_gate * self.s_gate_scale).square())
        return self.o_proj(unit(out))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.intermediate_size
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.suv_gate = nn.Parameter(torch.empty(width))
        self.suv_up = nn.Parameter(torch.empty(width))
        self.suv_scale = args.hidden_size**0.5
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x) * (self.suv_gate * self.suv_scale)
        up = self.up_proj(x) * (self.suv_up * self.suv_scale)
        return self.down_proj(unit(self.act(gate) * up))


class DecoderLayer(nn.Module):
    """h = unit(x); h += |rate_1| * (unit(attn(h)) - h); h = unit(h);
    h += |rate_2| * (unit(mlp(h)) - h)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.lambda_1 = nn.Parameter(torch.empty(args.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(args.hidden_size))
        self.lambda_scale = args.ngpt_alpha_init / args.initializer_range
        self.frame_kind = args.frame_kind(layer)

    def forward(
        self, x: torch.Tensor, frames: dict[str, Frame], cache: KVCache | None, entry: int
    ) -> torch.Tensor:
        h = unit(x)
        attended = unit(self.self_attn(h, frames[self.frame_kind], cache, entry))
        h = h + (self.lambda_1 * self.lambda_scale).abs() * (attended - h)
        h = unit(h)
        fed = unit(self.mlp(h))
        return h + (self.lambda_2 * self.lambda_scale).abs() * (fed - h)


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        positions = args.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim, positions)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim, positions
        )


class LMHead(nn.Module):
    """The output matrix with a learned scale per token: logits * logit_scale / s0. Not
    an nn.Linear, which the loader would swap for a QuantLinear without the scale."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size))
        self.logit_scale = nn.Parameter(torch.empty(args.vocab_size))
        self.logit_scale_factor = 1 / args.initializer_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight).float()
        return logits * (self.logit_scale.float() * self.logit_scale_factor)


class Model(nn.Module):
    """embed -> input layers -> recurrent layers, n_recurrent_loops times -> output
    layers -> unit() -> lm_head, with transformers' module names."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = LMHead(args)

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
            raise UnsupportedError("Dory has no static decode step (CUDA graphs)")
        args, layers = self.args, self.model.layers
        x = self.model.embed_tokens(input_ids)
        frames = self.frame(positions, cache, x.dtype, last)
        for i in range(args.n_input_layers):
            x = layers[i](x, frames, cache, i)
        start = unit(x)
        for loop in range(args.n_recurrent_loops):
            x = unit(x) + start
            for i in args.recurrent:
                x = layers[i](x, frames, cache, args.cache_entry(i, loop))
        for i in range(args.recurrent.stop, args.num_hidden_layers):
            x = layers[i](x, frames, cache, i)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(unit(x))

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        """A Frame per layer type (layer_frames), and UNRINGED's: the sliding layers'
        angles with the window as a mask over every cached position."""
        body, window = self.model, self.args.sliding_window
        frames = layer_frames(
            positions, cache, dtype, window, body.rotary_emb, body.rotary_emb_local, last
        )
        local = frames["sliding_attention"]
        mask = local.mask
        if local.plan is not None:
            keys = key_positions(positions, local.length, cache)
            mask = attention_mask(positions, keys, window)
        frames[UNRINGED] = Frame(positions, local.start, local.length, mask, local.cos, local.sin)
        return frames

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        windows = args.layer_windows()
        return KVCache(
            len(windows), batch, args.num_key_value_heads, max_seq_len, args.head_dim,
            dtype, device, windows=windows,
        )  # fmt: skip
