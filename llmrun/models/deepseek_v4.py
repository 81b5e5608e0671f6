"""DeepSeek-V4 (HF deepseek_v4; llama.cpp's GGUF arch "deepseek4"). Little of V2/V3's
model survives; what is new:

- Attention is multi-query with one shared head of head_dim (512) that is both key and
  value (kv_proj -> kv_norm), queries through a low-rank bottleneck (q_a_proj -> q_a_norm
  -> q_b_proj, then an unweighted RMSNorm per head). RoPE turns adjacent pairs of each
  head's *last* qk_rope_head_dim features; as values are keys, the output's rope part is
  turned back at the query's position. Every head has a learned sink logit in its
  softmax (as gpt-oss). The output projection is grouped: o_groups groups of heads each
  projected to o_lora_rank (o_a_proj, block-diagonal), then mixed (o_b_proj).
- Each layer is "sliding_attention" (its last sliding_window tokens), or also sees
  compressed entries: every compress_rate tokens of a "heavily_compressed_attention"
  layer pool into one (softmax over the window of gate_proj(x) + position_bias, per
  feature, weighting kv_proj(x); kv_norm, RoPE at the window's first position with the
  "compress" RoPE); a "compressed_sparse_attention" layer pools overlapping windows of
  2 * compress_rate (two series: the previous window's first half, this one's second)
  and a lightning indexer (the same pooling at index_head_dim, its own queries from the
  queries' latent) picks the index_topk entries each query attends to. A query sees an
  entry once its window has closed.
- The residual is hc_mult streams (manifold-constrained hyper-connections): before each
  sublayer a learned mix collapses them to its input, after it the output is spread back
  and the streams mixed by a doubly-stochastic matrix (Sinkhorn-Knopp); a last mix
  (hc_head) collapses them before the final norm.
- Experts are scored sqrt(softplus(logit)) (or sigmoid/softmax), chosen by score +
  e_score_correction_bias, or by a fixed token -> experts table (tid2eid) in the first
  "hash_moe" layers; weights renormalized (always, as transformers does) times
  routed_scaling_factor. Routed and shared experts clamp their SwiGLU inputs
  (swiglu_limit).

The KV cache holds, per token and layer, one row (one KV head, its values the keys):
the token's key, its compressor's (and indexer's) kv and gate projections and, at the
last token of each window, the window's compressed entry (and the indexer's). An entry
is pooled once, when its window's last token is written, from the rows of its window;
queries read the keys, and the entries at every compress_rate-th row. So prefix reuse,
chunked prefill, --cache-type and serve's paged blocks keep everything as they keep
keys; each layer's rows are as wide as its kind needs (cache_shapes).

The Hub's checkpoints end with a multi-token-prediction layer, which transformers
ignores, and so does llmrun.

Reference: transformers/models/deepseek_v4/modeling_deepseek_v4.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models.base import (
    ROPE_TYPES,
    Frame,
    RMSNorm,
    RotaryEmbedding,
    key_positions,
    mix_experts,
)
from llmrun.models.cache import KVCache
from llmrun.models.gpt_oss import sink_attention

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
# Legacy per-layer compress_ratios: 0 sliding, 4 CSA, 128 HCA (transformers' table).
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
DEFAULT_HASH_LAYERS = 3
ROW_BLOCK = 32


@dataclass
class ModelArgs:
    """DeepseekV4Config's fields and defaults (legacy fields folded in by from_config)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list[str] | None = None
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: list[str] | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 64 / 512
    # {"main": the sliding layers' RoPE, "compress": the compressed layers' and their
    # compressors' and indexers'}, each with rope_type and rope_theta.
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: 2 HCA, then CSA/HCA in turn
            self.layer_types = [HCA] * min(n, 2) + [
                CSA if i % 2 else HCA for i in range(max(n - 2, 0))
            ]
        if self.mlp_layer_types is None:
            hashed = min(n, DEFAULT_HASH_LAYERS)
            self.mlp_layer_types = ["hash_moe"] * hashed + ["moe"] * (n - hashed)
        for name, kinds, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES),
        ):
            if len(kinds) < n:
                raise ModelFormatError(f"{name} lists {len(kinds)} layers for {n}")
            bad = sorted(set(kinds[:n]) - set(allowed))
            if bad:
                raise UnsupportedError(
                    f"DeepSeek-V4 {name} {bad} are not supported ({', '.join(allowed)} are)"
                )
        self.layer_types, self.mlp_layer_types = (
            list(self.layer_types[:n]),
            list(self.mlp_layer_types[:n]),
        )
        if self.scoring_func not in SCORING:
            raise UnsupportedError(
                f"DeepSeek-V4 scoring_func {self.scoring_func!r} is not supported "
                f"({', '.join(SCORING)} are)"
            )
        if self.n_shared_experts != 1:
            raise UnsupportedError(
                f"DeepSeek-V4 with {self.n_shared_experts} shared experts is not supported "
                "(transformers builds one)"
            )
        if self.num_key_value_heads != 1:
            raise ModelFormatError(
                f"DeepSeek-V4 attends to one shared key/value head, not {self.num_key_value_heads}"
            )
        heads_dim = self.num_attention_heads * self.head_dim
        if heads_dim % self.o_groups:
            raise ModelFormatError(
                f"{self.num_attention_heads} heads of {self.head_dim} do not split into "
                f"{self.o_groups} output groups"
            )
        rope_dim = self.qk_rope_head_dim
        if rope_dim % 2 or not 0 < rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ModelFormatError(
                f"RoPE's {rope_dim} features do not fit heads of {self.head_dim} and indexer "
                f"heads of {self.index_head_dim}"
            )
        for kind in (CSA, HCA):
            if kind in self.layer_types and self.compress_rates.get(kind, 0) < 1:
                raise ModelFormatError(f"compress_rates gives {kind} no positive rate")

    @property
    def qk_rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer: int) -> int:
        return self.compress_rates.get(self.layer_types[layer], 0)

    def row_width(self, layer: int) -> int:
        """Features `layer` keeps per token in the cache (see Row), padded to whole blocks
        of 32 (a q8_0 cache's)."""
        width = Row(self, self.layer_types[layer]).width
        return -(-width // ROW_BLOCK) * ROW_BLOCK

    def cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's (KV heads, head width) in the KV cache: one row of its own width."""
        return [(1, self.row_width(i)) for i in range(self.num_hidden_layers)]

    @property
    def cache_head_dim(self) -> int:
        return max(width for _, width in self.cache_shapes())

    @property
    def cache_values_are_keys(self) -> bool:
        return True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """transformers' DeepseekV4Config.__post_init__: the legacy fields compress_ratios,
        compress_rate_csa/hca, num_hash_layers and qk_rope_head_dim folded in; RoPE as
        {"main", "compress"}, from nested rope_parameters or a flat rope_scaling (which
        only the compressed layers take, YaRN without its attention factor)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        n = values.get("num_hidden_layers", cls.num_hidden_layers)
        rates = dict(values.get("compress_rates") or {CSA: 4, HCA: 128})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if config.get(legacy) is not None:
                rates[kind] = config[legacy]
        values["compress_rates"] = rates
        ratios = config.get("compress_ratios")
        if values.get("layer_types") is None and ratios is not None:
            unknown = sorted(set(ratios) - set(RATIO_TYPES))
            if unknown:
                raise UnsupportedError(
                    f"DeepSeek-V4 compress_ratios {unknown} are not supported (0, 4, 128 are)"
                )
            values["layer_types"] = [RATIO_TYPES[r] for r in ratios]
        hashed = config.get("num_hash_layers")
        if values.get("mlp_layer_types") is None and hashed is not None:
            values["mlp_layer_types"] = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        head_dim = values.get("head_dim", cls.head_dim)
        if config.get("partial_rotary_factor") is None and config.get("qk_rope_head_dim"):
            values["partial_rotary_factor"] = config["qk_rope_head_dim"] / head_dim
        factor = values.get("partial_rotary_factor", cls.partial_rotary_factor)
        values["rope_parameters"] = _rope(config, factor)
        return cls(**values)


def _rope(config: dict[str, Any], factor: float) -> dict[str, dict[str, Any]]:
    raw = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(raw.get("main"), dict) and isinstance(raw.get("compress"), dict):
        kinds = {"main": dict(raw["main"]), "compress": dict(raw["compress"])}
    else:
        scaling = {k: v for k, v in raw.items() if k not in ("main", "compress")}
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        if scaling["rope_type"] == "yarn":
            # transformers: the V4 reference does not scale cos/sin by YaRN's mscale.
            scaling.setdefault("attention_factor", 1.0)
        kinds = {
            "main": {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)},
            "compress": {**scaling, "rope_theta": config.get("compress_rope_theta", 160000.0)},
        }
    for params in kinds.values():
        params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
        params.setdefault("partial_rotary_factor", factor)
        if params["rope_type"] not in ROPE_TYPES:
            raise UnsupportedError(
                f"RoPE type {params['rope_type']!r} is not supported ({', '.join(ROPE_TYPES)} are)"
            )
        if params["rope_type"] in ("yarn", "llama3", "longrope"):
            params.setdefault(
                "original_max_position_embeddings",
                config.get("original_max_position_embeddings")
                or config.get("max_position_embeddings", ModelArgs.max_position_embeddings),
            )
    return kinds


class Row:
    """Where a layer of `kind` keeps each feature of its cached row: the key [0, head_dim),
    then for a compressed layer the compressor's kv and gate projections (two series of
    head_dim each for CSA, one for HCA) and its entry, then for CSA the indexer's kv,
    gate (two series of index_head_dim) and entry."""

    def __init__(self, args: ModelArgs, kind: str) -> None:
        hd, ih = args.head_dim, args.index_head_dim
        series = 2 if kind == CSA else 1
        spans: list[tuple[str, int]] = [("key", hd)]
        if kind != SLIDING:
            spans += [("kv", series * hd), ("gate", series * hd), ("entry", hd)]
        if kind == CSA:
            spans += [("index_kv", 2 * ih), ("index_gate", 2 * ih), ("index_entry", ih)]
        self.slices, start = {}, 0
        for name, width in spans:
            self.slices[name] = slice(start, start + width)
            start += width
        self.width = start


@dataclass
class V4Frame(Frame):
    """A Frame with both RoPEs as half-width (one angle per pair) cos and sin [B, 1, T,
    rope_dim / 2], the tokens (hash routing), and which of the L key positions each
    query follows: causal [B, T, L] (mask: its window of them, [B, 1, T, L])."""

    compress_cos: torch.Tensor | None = None
    compress_sin: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    causal: torch.Tensor | None = None


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with adjacent pairs of its last 2 * cos.shape[-1] features turned by the
    angles whose cos and sin are given (broadcast against x's leading dims)."""
    rope_dim = 2 * cos.shape[-1]
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], turned.to(x.dtype)), dim=-1)


def turn_back(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention's output [B, H, T, D] with its rope part turned back at the query's
    position: the values are the keys, turned at theirs."""
    return rotate_tail(x, cos, -sin)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class GroupedLinear(nn.Module):
    """o_a_proj: each of `groups` groups of input features [..., groups, in] through its
    own [out, in] block of `weight` [groups * out, in]; returns [..., groups * out]."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        # [..., G, in] x [G, out, in] -> [..., G, out]
        return torch.einsum("...gi,goi->...go", x, w.to(x.dtype)).flatten(-2)


class Pooling(nn.Module):
    """A compressor (transformers' names): per token kv_proj and gate_proj (`series` of
    `dim` features each); per closed window of `rate` tokens one entry [dim], the
    softmax-weighted (gate + position_bias, per feature) sum of the window's kv,
    RMS-normed, turned at the window's first position. With two series (CSA), the entry
    pools the previous window's first series and this window's second."""

    def __init__(self, args: ModelArgs, dim: int, rate: int, series: int) -> None:
        super().__init__()
        self.dim, self.rate, self.series = dim, rate, series
        self.kv_proj = nn.Linear(args.hidden_size, series * dim, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, series * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, series * dim))
        self.kv_norm = RMSNorm(dim, args.rms_norm_eps)

    def entries(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ends: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """The entries [N, dim] of the windows that end at positions `ends` [N], from the
        rows' kv and gate [N, span, series * dim] of the span = series * rate positions up
        to each end (those below position 0 left out)."""
        rate, dim, span = self.rate, self.dim, kv.shape[1]
        # Each slot's bias by its place in its window.
        gate = gate.float() + self.position_bias.float().repeat(span // rate, 1)
        if self.series == 2:
            # [N, 2 * rate, 2 * dim] -> [N, 2 * rate, dim]: the previous window's first
            # series, then this window's second.
            kv = torch.cat((kv[:, :rate, :dim], kv[:, rate:, dim:]), dim=1)
            gate = torch.cat((gate[:, :rate, :dim], gate[:, rate:, dim:]), dim=1)
        slots = ends[:, None] - span + 1 + torch.arange(span, device=ends.device)
        gate = gate.masked_fill((slots < 0)[..., None], float("-inf"))
        weights = torch.softmax(gate, dim=1).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = rotary(ends[None] - rate + 1)
        half = cos.shape[-1] // 2
        return rotate_tail(
            pooled, cos[0, :, :half].to(pooled.dtype), sin[0, :, half:].to(pooled.dtype)
        )


class Indexer(Pooling):
    """The lightning indexer: its own pooling at index_head_dim, and which entries each
    query attends to: the index_topk it scores highest, sum_h w_h * relu(q_h . entry) *
    index_head_dim^-0.5, w = weights_proj(x) * index_n_heads^-0.5."""

    def __init__(self, args: ModelArgs, rate: int) -> None:
        super().__init__(args, args.index_head_dim, rate, 2)
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk = args.index_topk
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)

    def choose(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        entries: torch.Tensor,
        visible: torch.Tensor,
        frame: V4Frame,
    ) -> torch.Tensor:
        """Which of the entries [B, E, D] each query of x [B, T, hidden] attends to,
        among those `visible` [B, T, E]: a mask [B, T, E]."""
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, T, H, D], turned at each query's position
        q = self.q_b_proj(q_resid).view(batch, tokens, self.n_heads, self.head_dim)
        q = rotate_tail(q, frame.compress_cos.transpose(1, 2), frame.compress_sin.transpose(1, 2))
        # [B, T, H, D] @ [B, 1, D, E] -> [B, T, H, E]
        scores = torch.matmul(q.float(), entries.float().transpose(-1, -2)[:, None])
        scores = F.relu(scores) * self.head_dim**-0.5
        weights = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [B, T, H]
        index = (scores * weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


class Compressor(Pooling):
    """A compressed layer's compressor, with an indexer for CSA."""

    def __init__(self, args: ModelArgs, kind: str, rate: int) -> None:
        super().__init__(args, args.head_dim, rate, 2 if kind == CSA else 1)
        self.indexer = Indexer(args, rate) if kind == CSA else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.kind = layer, args.layer_types[layer]
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.eps = args.rms_norm_eps
        self.rate = args.compress_rate(layer)
        self.row = Row(args, self.kind)
        self.width = args.row_width(layer)
        self.scale = self.head_dim**-0.5
        self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_groups = args.o_groups
        self.o_a_proj = GroupedLinear(
            self.n_heads * self.head_dim // args.o_groups, args.o_lora_rank, args.o_groups
        )
        self.o_b_proj = nn.Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads))
        self.compressor = None if self.kind == SLIDING else Compressor(args, self.kind, self.rate)
        # Set by Model: the compressed layers' RoPE (a module of the body, shared).
        self.compress_rotary: list[RotaryEmbedding] = []

    def forward(self, x: torch.Tensor, frame: V4Frame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        compressed = self.kind != SLIDING
        cos, sin = (
            (frame.compress_cos, frame.compress_sin) if compressed else (frame.cos, frame.sin)
        )
        q_resid = self.q_a_norm(self.q_a_proj(x))
        # [B, T, H*D] -> [B, H, T, D]
        q = self.q_b_proj(q_resid).view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        q = rotate_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        key = rotate_tail(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)  # [B, 1, T, D]
        row = self._row(x, key)
        rows = self._store(row, frame, cache)
        keys = rows[..., : self.head_dim]
        mask = frame.mask
        if compressed:
            rows = self._pool_entries(row, rows, frame, cache)
            keys, mask = self._with_entries(x, q_resid, rows, frame)
        out = sink_attention(q, keys, keys, mask, self.scale, self.sinks)
        # [B, T, H*D] -> [B, H, T, D]: the rope part turned back at the query's position
        out = out.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)
        out = turn_back(out, cos, sin).transpose(1, 2)
        # [B, T, H, D] -> [B, T, groups, H*D / groups]
        grouped = out.reshape(batch, tokens, self.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    def _row(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """The new tokens' cache rows [B, 1, T, width], their entries zero."""
        parts = [key]
        if self.compressor is not None:
            c = self.compressor
            parts += [c.kv_proj(x)[:, None], c.gate_proj(x)[:, None]]
            parts.append(key.new_zeros(*key.shape[:-1], self.head_dim))
            if c.indexer is not None:
                i = c.indexer
                parts += [i.kv_proj(x)[:, None], i.gate_proj(x)[:, None]]
                parts.append(key.new_zeros(*key.shape[:-1], i.head_dim))
        row = torch.cat([p.to(key.dtype) for p in parts], dim=-1)
        return F.pad(row, (0, self.width - row.shape[-1]))

    def _store(self, row: torch.Tensor, frame: V4Frame, cache: KVCache | None) -> torch.Tensor:
        """`row` written to the cache; the rows [B, 1, L, width] of every key position."""
        if cache is None:
            return row
        if cache.paged:
            cache.write(self.layer, row, row, frame.positions)
            return cache.read(self.layer, frame.length, row.dtype)[0]
        return cache.update(self.layer, row, row, frame.positions, frame.start, frame.length)[0]

    def _pool_entries(
        self, row: torch.Tensor, rows: torch.Tensor, frame: V4Frame, cache: KVCache | None
    ) -> torch.Tensor:
        """The entries of the windows the new tokens close, pooled from `rows` and put in
        their rows (written again); returns the rows with them."""
        rate = self.rate
        closing = ((frame.positions + 1) % rate == 0).nonzero()  # [N, 2]: (row, token)
        if closing.shape[0] == 0:
            return rows
        b, t = closing[:, 0], closing[:, 1]
        ends = frame.positions[b, t]
        # The index of a position among the rows: itself (a cache's rows start at 0, and
        # so do the tokens of a forward without one).
        c, s = self.compressor, self.row.slices
        row = row.clone()
        entry = self._pooled(c, rows, b, ends, s["kv"], s["gate"])
        row[b, 0, t, s["entry"]] = entry.to(row.dtype)
        if c.indexer is not None:
            entry = self._pooled(c.indexer, rows, b, ends, s["index_kv"], s["index_gate"])
            row[b, 0, t, s["index_entry"]] = entry.to(row.dtype)
        if cache is None:
            return row
        return self._store(row, frame, cache)

    def _pooled(
        self,
        pool: Pooling,
        rows: torch.Tensor,
        b: torch.Tensor,
        ends: torch.Tensor,
        kv: slice,
        gate: slice,
    ) -> torch.Tensor:
        """`pool`'s entries of the windows of batch rows `b` ending at `ends`, from the
        rows' `kv` and `gate` features."""
        span = pool.rate * pool.series
        # [N, span]: each window's rows (clamped at 0; pooling ignores those below it)
        index = (ends[:, None] - span + 1 + torch.arange(span, device=ends.device)).clamp(min=0)
        window = rows[b[:, None], 0, index]  # [N, span, width]
        return pool.entries(window[..., kv], window[..., gate], ends, self.compress_rotary[0])

    def _with_entries(
        self, x: torch.Tensor, q_resid: torch.Tensor, rows: torch.Tensor, frame: V4Frame
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys [B, 1, L + E, D]: every position's, then the E closed windows'
        entries (at every rate-th row); the mask [B, 1, T, L + E] of those each query
        sees: its window, the entries of windows closed by its position (CSA: those its
        indexer chose)."""
        rate, s = self.rate, self.row.slices
        ends = rows[:, 0, rate - 1 :: rate]  # [B, E, width]
        visible = frame.causal[:, :, rate - 1 :: rate]  # [B, T, E]
        keys = rows[..., : self.head_dim]
        entries = ends[..., s["entry"]]
        indexer = self.compressor.indexer
        if indexer is not None and entries.shape[1]:
            visible = indexer.choose(x, q_resid, ends[..., s["index_entry"]], visible, frame)
        keys = torch.cat((keys, entries[:, None]), dim=2)
        mask = torch.cat((frame.mask, visible[:, None]), dim=-1)
        return keys, mask


class Expert(nn.Module):
    """SwiGLU with its inputs clamped: silu(min(gate, limit)) * clamp(up, +-limit)."""

    def __init__(self, args: ModelArgs, width: int | None = None) -> None:
        """`width`: the intermediate width, moe_intermediate_size unless given."""
        super().__init__()
        width = width or args.moe_intermediate_size
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.limit = args.swiglu_limit

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """What the native experts path (llmrun.quant.experts) combines gate and up with."""
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, args: ModelArgs, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.top_k, self.scoring = args.num_experts_per_tok, args.scoring_func
        self.scale = args.routed_scaling_factor
        if hashed:
            # Expert ids; stored as the file gives them (the loader may hand floats).
            self.register_buffer(
                "tid2eid", torch.zeros(args.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [N, top_k] (f32) and experts [N, top_k] of x [N, hidden]."""
        logits = F.linear(x, self.weight.to(x.dtype)).float()
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        if hasattr(self, "tid2eid"):
            if tokens is None:
                raise UnsupportedError("DeepSeek-V4's hash-routed layers need the token ids")
            indices = self.tid2eid[tokens.reshape(-1)].long()
        else:
            choice = scores + self.e_score_correction_bias.float()
            indices = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.gate = Router(args, args.mlp_layer_types[layer] == "hash_moe")
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.n_routed_experts))
        self.shared_experts = Expert(args)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat, tokens)
        routed = mix_experts(flat, weights.to(x.dtype), indices, self.experts)
        return routed.view(shape) + self.shared_experts(x)


class HyperConnection(nn.Module):
    """The mix around a sublayer: from the hc_mult streams [B, T, n, D] (flattened,
    RMS-normed), pre (collapses them to the sublayer's input), post (spreads its output)
    and comb (mixes the streams; Sinkhorn-Knopp-normalized to doubly stochastic)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n = self.n = args.hc_mult
        self.iters, self.hc_eps, self.eps = args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * args.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, eps = self.n, self.hc_eps
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.eps)
        mixes = F.linear(flat, self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = comb.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre[..., None] * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def spread(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """The streams after a sublayer: its output [B, T, D] spread by post [B, T, n], plus
    the streams [B, T, n, D] mixed by comb [B, T, n, n] (stream j into stream k by
    comb[j, k])."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[..., None, :] + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class Layer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MoE(args, layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def forward(self, x: torch.Tensor, frame: V4Frame, cache: KVCache | None) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(x)
        x = spread(x, self.self_attn(self.input_layernorm(collapsed), frame, cache), post, comb)
        post, comb, collapsed = self.ffn_hc(x)
        out = self.mlp(self.post_attention_layernorm(collapsed), frame.tokens)
        return spread(x, out, post, comb)


class HyperHead(nn.Module):
    """The last collapse of the streams [B, T, n, D] into one [B, T, D]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n = args.hc_mult
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * args.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(x.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * x).sum(dim=2).to(x.dtype)


class Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args, i) for i in range(args.num_hidden_layers))
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        rope = args.rope_parameters
        self.rotary_emb = RotaryEmbedding(rope["main"], args.head_dim, args.max_position_embeddings)
        self.compress_rotary_emb = RotaryEmbedding(
            rope["compress"], args.head_dim, args.max_position_embeddings
        )
        for layer in self.layers:
            layer.self_attn.compress_rotary.append(self.compress_rotary_emb)


class Model(nn.Module):
    """embed -> hc_mult streams -> layers -> hc_head -> norm -> lm_head, with
    transformers' module names."""

    decode_step = None  # no native decode step: see llmrun.quant.decode_step.FAMILIES

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Body(args)
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
            raise UnsupportedError("DeepSeek-V4 has no static decode step (CUDA graphs)")
        x = self.model.embed_tokens(input_ids)
        frame = self.frame(positions, cache, x.dtype, input_ids)
        x = x[:, :, None].expand(-1, -1, self.args.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            x = layer(x, frame, cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(self.model.hc_head(x))).float()

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        tokens: torch.Tensor | None = None,
    ) -> V4Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        if cache is None and start != 0:
            raise UnsupportedError("DeepSeek-V4 without a KV cache starts at position 0")
        keys = key_positions(positions, length, cache)
        causal = keys[:, None, :] <= positions[:, :, None]  # [B, T, L]
        window = causal & (positions[:, :, None] - keys[:, None, :] < self.args.sliding_window)
        capacity = cache.max_seq_len if cache is not None else None

        def half_angles(rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary(positions, capacity)
            half = cos.shape[-1] // 2
            # [B, T, rope_dim] -> [B, 1, T, rope_dim / 2]: one angle per pair, sin unfolded
            return cos[:, None, :, :half].to(dtype), sin[:, None, :, half:].to(dtype)

        cos, sin = half_angles(self.model.rotary_emb)
        compress_cos, compress_sin = half_angles(self.model.compress_rotary_emb)
        return V4Frame(
            positions, start, length, window[:, None], cos, sin,
            compress_cos=compress_cos, compress_sin=compress_sin,
            tokens=tokens, causal=causal,
        )  # fmt: skip

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        return KVCache(
            args.num_hidden_layers, batch, 1, max_seq_len, args.cache_head_dim, dtype, device,
            values_are_keys=True, shapes=args.cache_shapes(),
        )  # fmt: skip
