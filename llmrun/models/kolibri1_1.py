"""Kolibri-1.1 (Aleph Alpha): Kolibri-1 (llmrun.models.kolibri1) with sparse indexed
attention in place of its global layers, keys and values shared between them, and
dense feed-forwards in the first layers (mlp_only_layers, mlp_only_intermediate_size).

Indexed-attention layers have no position encoding and attend, of the keys a query sees
(all earlier ones), to a selection an indexer makes without weights: a key's score is the
ReLU of its dot products with the query's first index_num_heads heads (key head 0's),
summed and scaled by head_dim^-0.5 / index_num_heads, queries and keys rounded to NVFP4
first. An indexer layer (index_layers) first chooses each query's pool: all its keys, or
past index_pool_size keys the index_pool_size / index_compression blocks of
index_compression keys whose NVFP4 mean key scores best (its newest, incomplete block
scoring 0). Each indexed layer then takes from its indexer's pool the index_topk best
keys, always with the first index_num_sink_tokens and the last index_num_local_tokens
(all keys for a query that sees no more than the three together); ties go to earlier
keys. Indexed layers attend to NVFP4-rounded keys and values. A layer whose
kv_source_layers entry names an earlier one has no key and value projections: it attends
to that layer's keys and values, and keeps no KV cache entry of its own.

Reference: transformers/models/kolibri1_1/modeling_kolibri1_1.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import kolibri1, kolibri1_1_config
from llmrun.models.base import (
    Body,
    Frame,
    RMSNorm,
    attend_scaled,
    attention,
    key_positions,
    layer_frames,
)
from llmrun.models.cache import KVCache
from llmrun.models.kolibri1_1_config import INDEXED, SLIDING
from llmrun.models.qwen3_moe import MLP

FP4_MAX, E4M3_MAX, SCALE_MIN = 6.0, 448.0, 2.0**-9


@dataclass
class ModelArgs(kolibri1.ModelArgs):
    # Kolibri1_1Config's defaults.
    index_layers: list[int] | None = None
    kv_source_layers: list[int] | None = None
    index_topk: int = 2048
    index_pool_size: int = 16384
    index_compression: int = 16
    index_num_heads: int = 12
    index_num_local_tokens: int = 128
    index_num_sink_tokens: int = 8
    mlp_only_layers: list[int] | None = None
    mlp_only_intermediate_size: int = 3584
    entries: list[int] = field(default_factory=list, init=False)  # each layer's KV entry

    def __post_init__(self) -> None:
        filled = kolibri1_1_config.layout(
            {
                "num_hidden_layers": self.num_hidden_layers,
                "layer_types": self.layer_types,
                "index_layers": self.index_layers,
                "kv_source_layers": self.kv_source_layers,
                "mlp_only_layers": self.mlp_only_layers,
            }
        )
        self.layer_types = filled["layer_types"]
        self.index_layers = filled["index_layers"]
        self.kv_source_layers = filled["kv_source_layers"]
        self.mlp_only_layers = filled["mlp_only_layers"]
        self.check_window_and_experts()
        for name in ("index_topk", "index_pool_size", "index_compression"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"Kolibri-1.1's {name} must be positive")
        if self.index_pool_size % self.index_compression:
            raise ModelFormatError("index_pool_size must be a multiple of index_compression")
        if self.head_dim % 16:
            raise ModelFormatError(
                "Kolibri-1.1's NVFP4 blocks of 16 need head_dim a multiple of 16"
            )
        if not 0 < self.index_num_heads <= self.num_attention_heads // self.num_key_value_heads:
            raise ModelFormatError(
                "index_num_heads must be between 1 and the query heads of key head 0"
            )
        owners = [i for i, source in enumerate(self.kv_source_layers) if source == i]
        self.entries = [owners.index(source) for source in self.kv_source_layers]

    def layer_windows(self) -> list[int | None]:
        """Per KV cache entry (the layers with keys and values of their own), its window."""
        return [
            self.sliding_window if self.layer_types[i] == SLIDING else None
            for i, source in enumerate(self.kv_source_layers)
            if source == i
        ]


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] rounded to NVFP4 and back: per 16 values of the last dimension an E4M3
    scale (max |x| / 6, clamped to [2^-9, 448]) and E2M1 values, rounded to nearest even."""
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = blocks.abs().amax(-1, keepdim=True) / FP4_MAX
    scale = scale.clamp(SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=FP4_MAX)
    # E2M1's magnitudes: steps of 0.5 below 2, of 1 below 4, of 2 up to 6.
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = torch.round(magnitude / step) * step
    return (rounded.copysign(scaled) * scale).flatten(-2).to(x.dtype)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of each row's k best finite scores [..., N], ties to lower indices."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    rank = tied.cumsum(-1)
    return above | (tied & (rank <= k - above.sum(-1, keepdim=True)))


class Indexer:
    """An indexed layer's choice of keys (see the module's docstring), for queries that
    see keys 0 .. length - 1 (causal; keys past a row's newest unseen)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        self.chooses_pool = layer in args.index_layers
        self.heads, self.topk = args.index_num_heads, args.index_topk
        self.pool_size, self.compression = args.index_pool_size, args.index_compression
        self.local, self.sinks = args.index_num_local_tokens, args.index_num_sink_tokens
        self.weight = args.head_dim**-0.5 / args.index_num_heads

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Routing queries [heads, T, D] against keys [N, D] -> scores [T, N] (f32)."""
        return (queries @ keys.T).relu().sum(0) * self.weight

    def select(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
        pool: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], keys [B, Hkv, L, D], visible [B, T, L] -> the keys each query
        attends to [B, T, L] and the pool they were chosen from (this layer's new one, or
        the indexer's `pool`)."""
        lengths = visible.shape[-1] - visible.flip(-1).int().argmax(-1)
        lengths = lengths * visible.any(-1)  # [B, T]: keys up to the last one seen
        if self.chooses_pool:
            pool = self._pool(q, keys, visible, lengths)
        selected = visible.clone()
        budget = self.topk + self.local + self.sinks
        positions = torch.arange(visible.shape[-1], device=visible.device)
        for b in range(visible.shape[0]):
            rows = (lengths[b] > budget).nonzero().squeeze(-1)
            if not len(rows):
                continue
            length = lengths[b, rows, None]
            routing_keys = nvfp4(keys[b, 0]).float()
            scores = self.score(nvfp4(q[b, : self.heads, rows]).float(), routing_keys)
            sinks = positions < self.sinks
            local = (positions >= length - self.local) & (positions < length)
            candidates = pool[b, rows] & ~sinks & (positions < length - self.local)
            chosen = top_k_mask(scores.masked_fill(~candidates, float("-inf")), self.topk)
            selected[b, rows] = (chosen | sinks | local) & visible[b, rows]
        return selected, pool

    def _pool(
        self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        pool, c = visible.clone(), self.compression
        unseen = ~visible.any(1)  # [B, L]: keys no query of the row sees stay out of means
        for b in range(visible.shape[0]):
            rows = (lengths[b] > self.pool_size).nonzero().squeeze(-1)
            if not len(rows):
                continue
            length = lengths[b, rows, None]
            own = keys[b, 0].masked_fill(unseen[b, :, None], 0.0)
            n_blocks = own.shape[0] // c
            # [n_blocks * c, D] -> [n_blocks, c, D] -> each block's NVFP4 mean key
            means = nvfp4(own[: n_blocks * c].float().unflatten(0, (n_blocks, c)).sum(1) / c)
            scores = self.score(nvfp4(q[b, : self.heads, rows]).float(), means)
            # One more column: the keys after the last whole block.
            scores = nn.functional.pad(scores, (0, 1))
            blocks = torch.arange(n_blocks + 1, device=scores.device)
            scores = torch.where(blocks < length // c, scores, 0.0)
            scores = scores.masked_fill(blocks >= (length + c - 1) // c, float("-inf"))
            chosen = top_k_mask(scores, self.pool_size // c)
            chosen = chosen.repeat_interleave(c, dim=-1)[:, : own.shape[0]]
            pool[b, rows] = chosen & visible[b, rows]
        return pool


class Attention(nn.Module):
    """Sliding-window layers as Kolibri-1's (RoPE, per-head q/k norms); indexed layers
    without RoPE, attending to their indexer's choice of NVFP4-rounded keys and values,
    their own or those of their kv_source_layers entry."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.entry = layer, args.entries[layer]
        self.source = args.kv_source_layers[layer]
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim, self.kind = args.head_dim, args.layer_types[layer]
        self.scale = self.head_dim**-0.5
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        if self.source == layer:  # a layer reading another's keys and values has none
            self.k_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
            self.v_proj = nn.Linear(args.hidden_size, kv_width, bias=False)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(q_width, args.hidden_size, bias=False)
        self.read_later = layer in args.kv_source_layers[layer + 1 :]
        self.indexer = Indexer(args, layer) if self.kind == INDEXED else None

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
        pool: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        frame = frames["full_attention" if self.indexer is not None else SLIDING]
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], each head normalized on its own
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        q = q.transpose(1, 2)
        if self.indexer is None:
            k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
            v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = frame.rotate(q), frame.rotate(k.transpose(1, 2))
            return self.o_proj(attend_scaled(q, k, v, self.entry, frame, cache, self.scale)), pool
        if self.source != self.layer:
            keys, values = shared[self.source]
        else:
            k = self.k_norm(self.k_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim))
            v = self.v_proj(x).view(batch, tokens, self.n_kv_heads, self.head_dim).transpose(1, 2)
            keys, values = self._all_keys(k.transpose(1, 2), v, frame, cache)
            if self.read_later:
                shared[self.layer] = keys, values
        # [B, T] and [B, L] -> [B, T, L]
        seen = key_positions(frame.positions, frame.length, cache)
        visible = seen[:, None, :] <= frame.positions[:, :, None]
        selected, pool = self.indexer.select(q, keys, visible, pool)
        out = attention(q, nvfp4(keys), nvfp4(values), selected[:, None], self.scale)
        return self.o_proj(out), pool

    def _all_keys(
        self, k: torch.Tensor, v: torch.Tensor, frame: Frame, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new k/v [B, Hkv, T, D] stored, and every key and value of positions
        0 .. frame.length - 1 (the new ones alone without a cache), in k's dtype."""
        if cache is None:
            return k, v
        if cache.paged:
            cache.write(self.entry, k, v, frame.positions)
            return cache.read(self.entry, frame.length, k.dtype)
        return cache.update(self.entry, k, v, frame.positions, frame.start, frame.length)


class DecoderLayer(nn.Module):
    """Kolibri-1's block: x + post_self_attn_norm(attn(norm(x))), then
    x + post_mlp_norm(mlp(post_attention_norm(x))), the mlp dense in mlp_only_layers."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = attention(args, layer)
        dense = layer in args.mlp_only_layers
        self.mlp = MLP(args, args.mlp_only_intermediate_size) if dense else mlp(args)
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_self_attn_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.post_mlp_layernorm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        frames: dict[str, Frame],
        cache: KVCache | None,
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
        pool: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, pool = self.self_attn(self.input_layernorm(x), frames, cache, shared, pool)
        x = x + self.post_self_attn_layernorm(attended)
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x))), pool


class Model(nn.Module):
    """embed -> layers (this forward's shared keys and values, and the latest indexer's
    pool, passed along) -> norm -> lm_head, with transformers' module names."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args, Attention, kolibri1.MoE, DecoderLayer)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

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
            raise UnsupportedError("Kolibri-1.1 has no static decode step (CUDA graphs)")
        x = self.model.embed_tokens(input_ids)
        frames = layer_frames(
            positions, cache, x.dtype, self.args.sliding_window, self.model.rotary_emb, last=last
        )
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pool = None
        for layer in self.model.layers:
            x, pool = layer(x, frames, cache, shared, pool)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        windows = args.layer_windows()
        return KVCache(
            len(windows), batch, args.num_key_value_heads, max_seq_len, args.head_dim,
            dtype, device, windows=windows,
        )  # fmt: skip
