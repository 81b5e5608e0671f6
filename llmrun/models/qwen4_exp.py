"""Qwen4-Exp (text; model_type qwen4_exp_text, and the language model of qwen4_exp
checkpoints, whose vision tower llmrun ignores): Qwen3.5-MoE's Gated DeltaNet and gated
attention layers and experts, with three additions.

Gated residual (hyper-connections): the residual is hc_count streams of hidden_size
features, the embedding repeated into each. Before each mixer and each feed-forward,
the streams are RMS-normalized one by one (1 + w weights over all of them), mixed into
the block's input by sigmoid(up(silu(down(x) / hc_count))) weights averaged over the
streams, and the block's output is added to stream i scaled by 2 sigmoid(inject_i(x) /
hc_count). These norms replace the layer norms; the model ends with a mixer alone (no
final norm) before lm_head.

QSA indexer (every full-attention layer): raw index keys (one head) are averaged over
blocks of indexer_compress_ratio tokens, RMS-normalized and turned by RoPE at the
block's first position; each of the indexer's query heads (normalized, turned at the
query's position) scores a block by relu(q . k); summed over heads, the scores pick the
indexer_budget / indexer_compress_ratio best complete blocks a query sees, and the query
attends to their tokens and to those after its last complete block. While a query sees
no more blocks than it may pick, that is plain causal attention. The cache keeps each
token's raw index key after every KV head's key (queries and values padded with zeros).

Per-layer embedding (PLE, on the layers ple_layer_ids names, one-indexed): each token's
2..ngram_size-grams, n-grams never crossing an EOS token, hashed (a product of each
token with a multiplier, XORed, modulo a prime per head) into heads_per_ngram heads per
order of one embedding table. Projected to a value and to a key per stream, the key
gates the value for each stream by sigmoid(signed sqrt(key . rms(stream) / sqrt(H))),
and the gated values plus silu of a dilated causal depthwise convolution (kernel
ple_conv_kernel_size, dilation ngram_size) of their RMS norms are added to the streams.
The state of a PLE layer (key num_hidden_layers + layer in cache.recurrent, beside its
Gated DeltaNet's under the layer's own index) is the convolution's last inputs and the
last ngram_size - 1 token ids.

Reference: transformers/models/qwen4_exp/modeling_qwen4_exp.py (Qwen4ExpForCausalLM,
the language model of Qwen4ExpForConditionalGeneration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import qwen2_moe, qwen3_5, qwen3_5_moe
from llmrun.models.base import (
    Body,
    CausalLM,
    Frame,
    GemmaRMSNorm,
    Hybrid,
    attend_scaled,
    attention,
    cached_keys_values,
)
from llmrun.models.cache import KVCache

INDEXER_FIELDS = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}
EXACT_IDS = 1 << 24  # token ids a float32 state row holds exactly

# The n-gram hash's constants (transformers' _build_layer_multipliers: SplitMix64).
_MASK64 = (1 << 64) - 1
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_SEED_STEP = 10007


@dataclass
class ModelArgs(qwen3_5_moe.ModelArgs):
    num_experts: int = 512
    num_experts_per_tok: int = 10
    always_renormalized: ClassVar[bool] = False  # norm_topk_prob says
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] = field(default_factory=list)
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    eos_token_id: int | list[int] | None = None
    # Per PLE layer: the hash's multipliers, each head's prime and offset in the table
    # (transformers' buffers; computed from seed and ngram_vocab_size_base unless a GGUF
    # gives them).
    ple_multipliers: list[list[int]] | None = None
    ple_head_vocab_sizes: list[list[int]] | None = None
    ple_head_offsets: list[list[int]] | None = None
    ple_table_rows: list[int] | None = None  # each layer's n-gram table's rows (padded)

    def __post_init__(self) -> None:
        # transformers names the full-attention layers "indexed_attention".
        if self.layer_types is not None:
            self.layer_types = [
                "full_attention" if kind == "indexed_attention" else kind
                for kind in self.layer_types
            ]
        super().__post_init__()
        missing = [name for name in INDEXER_FIELDS if getattr(self, name) is None]
        if missing:
            raise ModelFormatError(
                f"Qwen4-Exp's attention layers need the QSA indexer: no {', '.join(missing)}"
            )
        if (self.indexer_kv_heads or 1) != 1:
            raise UnsupportedError(
                f"Qwen4-Exp's QSA indexer with {self.indexer_kv_heads} key heads is not "
                "supported (one, as transformers requires)"
            )
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ModelFormatError("indexer_budget is not a multiple of indexer_compress_ratio")
        if self.gate_activation not in GATE_ACTIVATIONS:
            raise UnsupportedError(
                f"Qwen4-Exp's linear-attention output gate {self.gate_activation!r} is not "
                f"supported (supported: {', '.join(GATE_ACTIVATIONS)})"
            )
        if self.hc_count < 2:
            raise ModelFormatError(f"hc_count is {self.hc_count}; Qwen4-Exp needs 2 or more")
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        self.ple_embed_dim = self.ple_embed_dim or self.hidden_size
        if self.ple_layer_ids:
            self._check_ple()

    def _check_ple(self) -> None:
        heads = self.ngram_heads
        if heads <= 0 or self.ple_embed_dim % heads:
            raise ModelFormatError(
                f"ple_embed_dim ({self.ple_embed_dim}) is not a multiple of the n-gram heads "
                f"({heads})"
            )
        for layer_id in self.ple_layer_ids:
            if not 1 <= layer_id <= self.num_hidden_layers:
                raise ModelFormatError(f"ple_layer_ids names layer {layer_id} (one-indexed)")
            if self.layer_types[layer_id - 1] != "linear_attention":
                raise UnsupportedError(
                    f"Qwen4-Exp PLE on layer {layer_id}, a full-attention layer, is not "
                    "supported (transformers takes it on linear-attention layers only)"
                )
        if self.eos_id is None:
            raise ModelFormatError("Qwen4-Exp's PLE layers need eos_token_id")
        if self.vocab_size > EXACT_IDS:
            raise UnsupportedError(
                f"Qwen4-Exp PLE with {self.vocab_size} tokens is not supported (its state "
                f"keeps token ids as float32, exact up to {EXACT_IDS})"
            )
        if self.ple_multipliers is None:
            self._hash_tables()

    def _hash_tables(self) -> None:
        """transformers' hash constants for each PLE layer: the multipliers from the seed,
        each head's vocabulary the next prime after ngram_vocab_size_base - 1 (counting on
        from the previous layers' heads), offsets the running sum, rows padded."""
        count, heads = len(self.ple_layer_ids), self.ngram_heads
        primes = _primes_after(self.ngram_vocab_size_base - 1, count * heads)
        self.ple_multipliers, self.ple_head_vocab_sizes, self.ple_head_offsets = [], [], []
        self.ple_table_rows = []
        divisor = self.make_ngram_vocab_size_divisible_by
        for index in range(count):
            self.ple_multipliers.append(_multipliers(self, index))
            sizes = primes[index * heads : (index + 1) * heads]
            offsets = [sum(sizes[:h]) for h in range(heads)]
            self.ple_head_vocab_sizes.append(sizes)
            self.ple_head_offsets.append(offsets)
            self.ple_table_rows.append(-(-sum(sizes) // divisor) * divisor)

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def eos_id(self) -> int | None:
        """The EOS token the n-grams stop at (transformers': the first listed)."""
        eos = self.eos_token_id
        return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None

    @property
    def gate_activation(self) -> str:
        return self.output_gate_type or self.hidden_act

    @property
    def cache_head_dim(self) -> int:
        """The KV cache's width: each head's key, then the token's raw index key."""
        return self.head_dim + self.indexer_head_dim

    @property
    def ple_conv_state(self) -> int:
        """Inputs the dilated PLE convolution looks back over."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    def ple_key(self, layer: int) -> int:
        """cache.recurrent's key of `layer`'s PLE state (its own index keys the Gated
        DeltaNet's)."""
        return self.num_hidden_layers + layer

    def recurrent_shapes(self) -> dict[int, list[tuple[int, ...]]]:
        """qwen3_5's, and each PLE layer's convolution inputs [streams * hidden, state]
        and last ngram_size - 1 token ids."""
        shapes = super().recurrent_shapes()
        for layer_id in self.ple_layer_ids:
            width = self.hc_count * self.hidden_size
            shapes[self.ple_key(layer_id - 1)] = [
                (width, self.ple_conv_state),
                (self.ngram_size - 1,),
            ]
        return shapes

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config.get("text_config") or config)
        config["rope_parameters"] = dict(config.get("rope_parameters") or {})
        config["rope_parameters"].setdefault("partial_rotary_factor", 0.25)
        return super().from_config(config)


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _multipliers(args: ModelArgs, ple_index: int) -> list[int]:
    """Odd multipliers, one per n-gram position, small enough that token * multiplier
    fits in int64."""
    half = max(1, ((1 << 63) - 1) // max(args.vocab_size, 1) // 2)
    seed = args.seed + _LAYER_SEED_STEP * ple_index
    return [
        2 * (_splitmix64((seed + _GAMMA * (i + 1)) & _MASK64) % half) + 1
        for i in range(args.ngram_size)
    ]


def _primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes greater than `start`."""
    primes, n = [], start
    while len(primes) < count:
        n += 1
        if n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1)):
            primes.append(n)
    return primes


@dataclass
class TokenFrame(Frame):
    """A Frame with the token ids (PLE hashes them) and, where the indexer may choose,
    RoPE's cos/sin [1, 1, blocks, rotary_dim] at the first position of each complete
    block of keys."""

    ids: torch.Tensor | None = None
    block_cos: torch.Tensor | None = None
    block_sin: torch.Tensor | None = None


class GroupRMSNorm(nn.Module):
    """Each group of `group` features RMS-normalized on its own, then scaled by 1 + w
    (over all of them), in float32 (transformers' Qwen4ExpTextRMSNorm with group_size)."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.float().unflatten(-1, (-1, self.group))
        normed = F.rms_norm(groups, (self.group,), eps=self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedResidual(nn.Module):
    """The streams' mixer (see the module docstring): their mix, and with `inject` each
    stream's weight for the block's output."""

    def __init__(self, args: ModelArgs, inject: bool = True) -> None:
        super().__init__()
        self.streams, self.hidden = args.hc_count, args.hidden_size
        width = self.streams * self.hidden
        self.hc_norm = GroupRMSNorm(width, self.hidden, args.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(width, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, width, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(width, self.streams, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, streams * H] -> the block's input [B, T, H] and each stream's weight
        for its output [B, T, streams] (None without inject)."""
        normed = self.hc_norm(x)
        low = F.silu(self.input_mix_weight_down(normed) / self.streams)
        weights = torch.sigmoid(self.input_mix_weight_up(low)).unflatten(-1, (self.streams, -1))
        mixed = (weights * normed.unflatten(-1, (self.streams, -1))).mean(dim=-2)
        if not hasattr(self, "block_inject_weight"):
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.streams)

    def add(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """x plus the block's output out [B, T, H] in each stream, scaled by inject."""
        return x + (out[..., None, :] * inject[..., None]).flatten(-2)


class NGramEmbedding(nn.Module):
    """Each token's hashed 2..ngram_size-grams' embeddings, concatenated [B, T, E]."""

    def __init__(self, args: ModelArgs, ple_index: int) -> None:
        super().__init__()
        self.size, self.per_order = args.ngram_size, args.heads_per_ngram
        self.eos = args.eos_id
        self.multipliers = args.ple_multipliers[ple_index]
        self.vocab_sizes = args.ple_head_vocab_sizes[ple_index]
        self.offsets = args.ple_head_offsets[ple_index]
        self.ngram_embedding = nn.Embedding(
            args.ple_table_rows[ple_index], args.ple_embed_dim // args.ngram_heads
        )

    def forward(self, history: torch.Tensor, tokens: int) -> torch.Tensor:
        """history [B, ngram_size - 1 + T]: the tokens before this forward's T (EOS
        where none) and its own; the embeddings of the last `tokens`."""
        device = history.device
        # EOS tokens strictly before each position: an n-gram reaching back over one
        # takes EOS in its place, as does one reaching back past the history.
        before = F.pad(self.stops(history).long().cumsum(dim=1), (1, 0))[:, :-1]
        position = torch.arange(history.shape[1], device=device)
        multipliers = torch.tensor(self.multipliers, device=device)
        mixed, ids = history * multipliers[0], []
        for shift in range(1, self.size):
            source = (position - shift).clamp(min=0)
            shifted = history[:, source]
            crossed = (before - before[:, source]) > 0
            shifted = torch.where(crossed | (position < shift), self.eos, shifted)
            mixed = mixed ^ (shifted * multipliers[shift])
            heads = slice((shift - 1) * self.per_order, shift * self.per_order)
            sizes = torch.tensor(self.vocab_sizes[heads], device=device)
            offsets = torch.tensor(self.offsets[heads], device=device)
            ids.append(torch.remainder(mixed[..., None], sizes) + offsets)
        ngram_ids = torch.cat(ids, dim=-1)[:, -tokens:]  # [B, T, heads]
        return self.ngram_embedding(ngram_ids).flatten(-2)

    def stops(self, history: torch.Tensor) -> torch.Tensor:
        """Where the n-grams stop: history's EOS tokens."""
        return history == self.eos


class PLE(nn.Module):
    """The per-layer embedding added to the streams (see the module docstring)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.key = args.ple_key(layer)
        self.context = args.ngram_size - 1
        self.streams, self.hidden = args.hc_count, args.hidden_size
        self.eos = args.eos_id
        width, embed, eps = self.streams * self.hidden, args.ple_embed_dim, args.rms_norm_eps
        self.ple_embedding = NGramEmbedding(args, args.ple_layer_ids.index(layer + 1))
        self.key_proj = nn.Linear(embed, width, bias=False)
        self.value_proj = nn.Linear(embed, self.hidden, bias=False)
        self.norm_key = GroupRMSNorm(width, self.hidden, eps)
        self.norm_query = GroupRMSNorm(width, self.hidden, eps)
        self.norm_conv = GroupRMSNorm(width, self.hidden, eps)
        self.dilation, self.state_len = args.ngram_size, args.ple_conv_state
        self.conv1d = nn.Conv1d(
            width, width, args.ple_conv_kernel_size, groups=width,
            dilation=self.dilation, bias=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, frame: TokenFrame, cache: KVCache | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        ids = frame.ids
        if cache is None:
            conv_state = x.new_zeros(batch, x.shape[-1], self.state_len)
            context = ids.new_full((batch, self.context), self.eos)
            counts = torch.full((batch,), tokens, device=x.device)
        else:
            conv_state, kept_ids = cache.recurrent.read(self.key)
            # A row starting at position 0 has no tokens before: EOS stands for them.
            fresh = (frame.positions[:, :1] == 0).expand(-1, self.context)
            context = torch.where(fresh, self.eos, kept_ids.long())
            counts = frame.counts
        history = torch.cat((context, ids.long()), dim=1)
        embeddings = self.ple_embedding(history, tokens)
        keys = self.norm_key(self.key_proj(embeddings)).unflatten(-1, (self.streams, -1))
        value = self.value_proj(embeddings)
        queries = self.norm_query(x).unflatten(-1, (self.streams, -1))
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value[..., None, :]).flatten(-2)  # [B, T, streams*H]
        inputs = torch.cat((conv_state.to(x.dtype), self.norm_conv(gated).transpose(1, 2)), dim=2)
        conv = F.silu(
            F.conv1d(inputs, self.conv1d.weight, dilation=self.dilation, groups=inputs.shape[1])
        )
        if cache is not None:
            # Each row's last inputs and ids up to its last real token (padding left out).
            taps = counts[:, None] + torch.arange(self.state_len, device=x.device)
            kept = inputs.gather(2, taps[:, None].expand(-1, inputs.shape[1], -1))
            last = history.gather(1, counts[:, None] + torch.arange(self.context, device=x.device))
            cache.recurrent.write(self.key, [kept, last.float()])
        return gated + conv.transpose(1, 2)


class GatedDeltaNet(qwen3_5.GatedDeltaNet):
    """Qwen3.5's, its output gate silu or sigmoid (output_gate_type)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.norm = qwen3_5.GatedRMSNorm(
            self.v_dim, args.rms_norm_eps, GATE_ACTIVATIONS[args.gate_activation]
        )

    def _native_step(self, *args: Any) -> torch.Tensor | None:
        # The native step gates by silu only.
        return super()._native_step(*args) if self.norm.act is F.silu else None


class Indexer(nn.Module):
    """The QSA indexer's parameters and its choice of keys (see the module docstring)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.heads, self.dim = args.indexer_n_heads, args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.top = args.indexer_budget // self.ratio
        # transformers' index_qk_proj, split (as llama.cpp's converter splits it)
        self.index_q_proj = nn.Linear(args.hidden_size, self.heads * self.dim, bias=False)
        self.index_k_proj = nn.Linear(args.hidden_size, self.dim, bias=False)
        self.q_layernorm = GemmaRMSNorm(self.dim, args.rms_norm_eps)
        self.k_layernorm = GemmaRMSNorm(self.dim, args.rms_norm_eps)

    def choose(self, queries: torch.Tensor, keys: torch.Tensor, frame: TokenFrame) -> torch.Tensor:
        """Which of the raw index keys [B, L, D] (at positions 0 .. L-1) each query
        [B, Hi, T, D] (normalized, rotated) attends to: a mask [B, 1, T, L] (True: attend)
        that includes frame.mask."""
        length = keys.shape[1]
        blocks = length // self.ratio
        pooled = keys[:, : blocks * self.ratio].unflatten(1, (blocks, self.ratio))
        pooled = self.k_layernorm(pooled.float().mean(dim=2).to(keys.dtype))
        pooled = rotate_blocks(pooled[:, None], frame.block_cos, frame.block_sin)  # [B, 1, N, D]
        scores = torch.relu(queries.float() @ pooled.float().transpose(-1, -2))
        scores = scores.sum(dim=1) / math.sqrt(self.dim)  # [B, T, N]
        # A query sees the blocks complete up to its own position.
        seen = (frame.positions + 1) // self.ratio  # [B, T]
        block = torch.arange(blocks, device=keys.device)
        visible = block < seen[..., None]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.top, blocks), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True) & visible
        token = torch.arange(length, device=keys.device)
        token_block = (token // self.ratio).clamp(max=blocks - 1)
        in_chosen = chosen[..., token_block] & (token < blocks * self.ratio)
        tail = (token >= (seen * self.ratio)[..., None]) & (token <= frame.positions[..., None])
        mask = (in_chosen | tail)[:, None]
        return mask if frame.mask is None else mask & frame.mask


def rotate_blocks(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] turned by RoPE's cos/sin [1, 1, T, rotary_dim] (every row alike)."""
    batch = x.shape[0]
    return ops.rotary(x, cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1))


class Attention(qwen3_5.Attention):
    """Qwen3.5's gated attention over the keys the QSA indexer chooses."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__(args, index)
        self.indexer = Indexer(args)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        frame: TokenFrame,
        cache: KVCache | None,
    ) -> torch.Tensor:
        indexer, (batch, tokens, _) = self.indexer, x.shape
        # The raw index key rides after each KV head's key; zeros pad queries and values.
        index_k = indexer.index_k_proj(x)[:, None].expand(-1, self.n_kv_heads, -1, -1)
        k = torch.cat((k, index_k.to(k.dtype)), dim=-1)
        q, v = F.pad(q, (0, indexer.dim)), F.pad(v, (0, indexer.dim))
        scale = self.head_dim**-0.5
        if frame.block_cos is None:  # no query sees more blocks than it may choose
            out = attend_scaled(q, k, v, self.index, frame, cache, scale)
        else:
            if cache is not None and cache.paged:  # serve's blocks, read in position order
                cache.write(self.index, k, v, frame.positions)
                k, v = cache.read(self.index, frame.length, q.dtype)
            else:
                k, v = cached_keys_values(k, v, self.index, frame, cache, 0)
            index_q = indexer.index_q_proj(x).view(batch, tokens, indexer.heads, indexer.dim)
            index_q = frame.rotate(indexer.q_layernorm(index_q).transpose(1, 2))
            chosen = indexer.choose(index_q, k[:, 0, :, self.head_dim :], frame)
            out = attention(q, k, v, chosen, scale)
        return out.view(batch, tokens, self.n_heads, -1)[..., : self.head_dim].flatten(2)


class DecoderLayer(nn.Module):
    """An optional PLE, then the mixer and the feed-forward, each between its gated
    residual's mix and injection."""

    def __init__(self, args: ModelArgs, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        if args.layer_types[layer] == "linear_attention":
            self.linear_attn = GatedDeltaNet(args, layer)
        else:
            self.self_attn = attention(args, args.attention_layers.index(layer))
        self.mlp = mlp(args)
        if layer + 1 in args.ple_layer_ids:
            self.ple = PLE(args, layer)
        self.attn_hyper_connection = GatedResidual(args)
        self.mlp_hyper_connection = GatedResidual(args)

    def forward(self, x: torch.Tensor, frame: TokenFrame, cache: KVCache | None) -> torch.Tensor:
        if hasattr(self, "ple"):
            x = x + self.ple(x, frame, cache)
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        mixed, inject = self.attn_hyper_connection(x)
        x = self.attn_hyper_connection.add(x, mixer(mixed, frame, cache), inject)
        mixed, inject = self.mlp_hyper_connection(x)
        return self.mlp_hyper_connection.add(x, self.mlp(mixed), inject)


class ModelBody(Body):
    """The embedding, layers and RoPE, and the final mixer of the streams in place of a
    norm (`norm` is not taken)."""

    def __init__(
        self, args: ModelArgs, attention: type, mlp: type, layer: type, norm: nn.Module | None
    ) -> None:
        super().__init__(args, attention, mlp, layer, nn.Identity())
        self.hyper_connection_mixer = GatedResidual(args, inject=False)


class Model(Hybrid, CausalLM):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, Attention, qwen2_moe.SparseMoeBlock, DecoderLayer, body=ModelBody)

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
            raise UnsupportedError("Qwen4-Exp has no static decode step (CUDA graphs)")
        x = self.model.embed_tokens(input_ids)
        frame = self.token_frame(input_ids, positions, cache, x.dtype, last)
        x = x.repeat(1, 1, self.args.hc_count)
        for layer in self.model.layers:
            x = layer(x, frame, cache)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        elif last_only:
            x = x[:, -1:]
        mixed, _ = self.model.hyper_connection_mixer(x)
        return self.lm_head(mixed).float()

    def token_frame(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None,
    ) -> TokenFrame:
        """The frame of this forward, with its ids and the blocks' RoPE where a query
        sees more complete blocks than the indexer may choose."""
        frame = self.frame(positions, cache, dtype, last)
        frame = TokenFrame(**{f.name: getattr(frame, f.name) for f in fields(frame)}, ids=ids)
        ratio = self.args.indexer_compress_ratio
        blocks = frame.length // ratio
        if blocks > self.args.indexer_budget // ratio:
            starts = torch.arange(blocks, device=positions.device)[None] * ratio
            cos, sin = self.model.rotary_emb(starts, cache.max_seq_len if cache else None)
            frame.block_cos, frame.block_sin = cos[:, None].to(dtype), sin[:, None].to(dtype)
        return frame
