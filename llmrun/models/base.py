"""Primitives shared by the model families: config parsing, RMSNorm, RoPE, attention.

Pure torch. Config fields keep Hugging Face's names so a config.json maps 1:1;
RoPE scaling follows transformers' modeling_rope_utils (default, linear, llama3,
yarn, longrope) so logits match it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llmrun import ops
from llmrun.errors import ContextOverflowError, ModelFormatError, UnsupportedError
from llmrun.models.cache import KVCache, WindowPlan
from llmrun.models.paged import PagedView
from llmrun.models.recurrent import RecurrentState

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,  # OPT's
    "gelu": F.gelu,
    "gelu_pytorch_tanh": ops.gelu_tanh,
    "gelu_new": ops.gelu_tanh,  # transformers' NewGELUActivation: the same tanh formula
}


LAYER_TYPES = ("full_attention", "sliding_attention")


def args_from_config(cls: type, config: dict[str, Any], nullable: tuple[str, ...] = ()) -> Any:
    """Build a ModelArgs dataclass from a config.json dict, ignoring unknown fields.
    A null value means "the default", except for the `nullable` fields, where it
    means "none" (Gemma 2's final_logit_softcapping: null turns soft-capping off)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in config.items() if k in names and (v is not None or k in nullable)}
    values["rope_parameters"] = rope_parameters(config)
    return cls(**values)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config style, as one dict with rope_type and rope_theta.

    transformers 5 writes `rope_parameters` {rope_theta, rope_type, ...}; older
    files have `rope_theta` and `rope_scaling` at the top level.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = config.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedError(
            f"RoPE type {params['rope_type']!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    return params


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedError(
            f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        ) from None


def check_layer_types(layer_types: list[str], n_layers: int) -> list[str]:
    """A config's `layer_types`, refused when an entry is unknown or the count is wrong."""
    for kind in layer_types:
        if kind not in LAYER_TYPES:
            raise UnsupportedError(
                f"layer type {kind!r} is not supported (supported: {', '.join(LAYER_TYPES)})"
            )
    if len(layer_types) != n_layers:
        raise ModelFormatError(
            f"layer_types lists {len(layer_types)} layers, but num_hidden_layers is {n_layers}"
        )
    return list(layer_types)


def windowed_layer_types(
    layer_types: list[str] | None, n_layers: int, window: int | None, pattern: int = 2
) -> list[str]:
    """A config's `layer_types` (check_layer_types'), or where it gives none transformers'
    default: every `pattern`-th layer "full_attention", the others "sliding_attention";
    refused where sliding layers have no window."""
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    layer_types = check_layer_types(layer_types, n_layers)
    if "sliding_attention" in layer_types and not window:
        raise ModelFormatError("sliding_attention layers need a sliding_window")
    return layer_types


def sliding_windows(layer_types: list[str], window: int | None) -> list[int | None]:
    """Each layer's sliding window, None for full layers (what new_cache reads of a
    ModelArgs' layer_windows())."""
    return [window if kind == "sliding_attention" else None for kind in layer_types]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in float32 and cast back, as Gemma's checkpoints
    define it (transformers' GemmaRMSNorm). HF files store w; llama.cpp's GGUFs
    store 1 + w, which the loader turns back into w."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # decode on CPU: no casts to make
            return ops.rms_norm(x, self.weight, self.eps, offset=1.0)
        return ops.rms_norm(x.float(), self.weight.float(), self.eps, offset=1.0).type_as(x)


ROPE_TABLE = 512  # positions of cos/sin a decoding sequence computes at once


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions; `rotary_dim` may be less than head_dim (partial RoPE)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        base = params["rope_theta"]
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        dim = self.rotary_dim
        # Explicit CPU tensors: models are built under torch.device("meta"), and
        # these non-persistent buffers are not in any checkpoint.
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        inv_freq = 1.0 / (base**exponents)
        long_inv_freq = None
        self.attention_scaling = 1.0
        self.original_max = params.get("original_max_position_embeddings")
        rope_type = params["rope_type"]
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(params, dim, max_position_embeddings)
        elif rope_type == "longrope":
            factor = params.get("factor") or max_position_embeddings / self.original_max
            scaling = params.get("attention_factor")
            if scaling is None:
                scaling = (
                    1.0
                    if factor <= 1.0
                    else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
                )
            self.attention_scaling = scaling
            long_inv_freq = 1.0 / (
                torch.tensor(params["long_factor"], dtype=torch.float32, device="cpu")
                * base**exponents
            )
            inv_freq = 1.0 / (
                torch.tensor(params["short_factor"], dtype=torch.float32, device="cpu")
                * base**exponents
            )
        if "freq_factors" in params:
            inv_freq = inv_freq / torch.tensor(
                params["freq_factors"], dtype=torch.float32, device="cpu"
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        self._table: tuple[Any, ...] | None = None  # see _decoding

    def forward(
        self, positions: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [B, T, rotary_dim] (see ops.rotary). `capacity`: the
        positions the KV cache holds, where there is one (LongRoPE's choice, see _angles)."""
        if self.long_inv_freq is not None:
            return self._angles(positions, capacity)
        if (
            positions.shape == (1, 1)
            and positions.device.type == "cpu"
            and self.inv_freq.device.type == "cpu"
            and not torch.compiler.is_compiling()  # a static step reads no position back
        ):
            return self._decoding(positions)
        return self._angles(positions)

    def _decoding(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's next position: a row of a table of ROPE_TABLE positions from it
        on, computed as a prompt's are (the same values: elementwise ops) and kept for
        the tokens that follow, so a token costs two slices, not ten torch ops."""
        p, key = int(positions), (self.inv_freq.data_ptr(), self.inv_freq.dtype)
        table = self._table
        if table is None or table[0] != key or not table[1] <= p < table[1] + ROPE_TABLE:
            cos, sin = self._angles(torch.arange(p, p + ROPE_TABLE)[None])
            table = self._table = (key, p, cos[0], sin[0])
        _, first, cos, sin = table
        return cos[None, p - first : p - first + 1], sin[None, p - first : p - first + 1]

    def _angles(
        self, positions: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        # LongRoPE takes the long factors for a sequence that outgrows the pretraining
        # length. With a KV cache, judged once for the cache, as llama.cpp judges it by the
        # context size: judged per forward call (transformers' way), the keys of a prompt
        # prefilled in chunks, or of a chat's earlier turns, would keep factors that a
        # single forward would not give them. Without a cache, per forward call and row.
        if self.long_inv_freq is not None and capacity is not None:
            inv_freq = self.long_inv_freq if capacity > self.original_max else inv_freq
        elif self.long_inv_freq is not None:
            longer = positions.amax(dim=-1, keepdim=True) + 1 > self.original_max
            inv_freq = torch.where(longer[..., None], self.long_inv_freq, inv_freq)
        freqs = positions[..., None].float() * inv_freq
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        # Signs folded in: rotate_half(x) * sin == swap_halves(x) * cat(-sin, sin).
        return cos, torch.cat((-sin, sin), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = params.get("attention_factor")
    if scaling is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            scaling = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            scaling = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(scaling)


class PromptRows(NamedTuple):
    """A forward's prompt rows as ops.attend_prompt takes them (Frame.prompt): row b's
    first counts[b] queries at key positions starts[b] .. starts[b] + counts[b] - 1 of its
    keys in order, each seeing the keys up to its own (window > 0: only its last
    `window`)."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]
    window: int


@dataclass
class Frame:
    """What every layer of one forward needs to know about its tokens, worked out
    once: positions [B, T], the cache span they write and attend to, the mask,
    and the RoPE cos/sin in the compute dtype."""

    positions: torch.Tensor
    start: int  # first position of row 0
    length: int  # keys to attend to: positions 0 .. max(positions)
    mask: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    # Sliding-window layers of a cache that keeps only the window: how this
    # forward writes and reads their rings (mask is then plan.mask).
    plan: WindowPlan | None = None
    # One token attending to the cache's first `length` positions through the mask,
    # every shape fixed and no position read back to the host (llmrun.static_decode).
    static: bool = False
    # Each row's real tokens [B] where the cache carries a hybrid model's recurrent state
    # (rows padded on the right beyond them; see Hybrid); None otherwise.
    counts: torch.Tensor | None = None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] with RoPE applied at these positions."""
        return ops.rotary(x, self.cos, self.sin)

    @functools.cached_property
    def prompt(self) -> PromptRows | None:
        """What ops.attend_prompt takes for this forward's mask (it computes it without
        one), row by row (attend_prompt_rows), None for any other mask; worked out once a
        forward, on the CPU only. Each row's queries see its keys in order, each those
        before it and itself (all of them, or the last `window` positions); a row padded
        on the right repeats its last position. The keys: positions 0 .. length - 1, or
        one row's windowed ring (frame.plan) in position order and then the new ones."""
        mask, positions, plan = self.mask, self.positions, self.plan
        batch, tokens = positions.shape
        if self.static or mask is None or mask.device.type != "cpu" or mask.dtype != torch.bool:
            return None
        if plan is not None:  # one row's new keys, after its ring's in position order
            if plan.decode or plan.counts != [tokens] or (plan.with_ring and not plan.in_order):
                return None
            before = plan.in_order if plan.with_ring else 0
            positions = torch.arange(before, before + tokens)[None]
        starts = positions[:, 0]
        counts = positions[:, -1] - starts + 1
        steps = torch.minimum(torch.arange(tokens), (counts - 1)[:, None])
        length = int(positions.max()) + 1
        if (
            not torch.equal(positions, starts[:, None] + steps)
            or tuple(mask.shape) != (batch, 1, tokens, length)
            or (plan is None and length != self.length)
        ):
            return None
        behind = positions[:, :, None] - torch.arange(length)  # [B, T, L]: query minus key
        seen = mask[:, 0]
        window = 0
        if not torch.equal(seen, behind >= 0):
            window = int(seen[:, -1].sum(-1).max())  # the most keys a row's last query sees
            if window < 1 or not torch.equal(seen, (behind >= 0) & (behind < window)):
                return None
        return PromptRows(tuple(starts.tolist()), tuple(counts.tolist()), window)


def rotate_pairs(x: torch.Tensor, frame: Frame) -> torch.Tensor:
    """x [B, H, T, D] with RoPE applied at the frame's positions to adjacent pairs
    (x[2i], x[2i+1]) of its first rotary_dim features: the layout of GLM-4, ERNIE 4.5,
    Command-R and DeepSeek (llama.cpp's "normal" RoPE, which their GGUFs keep), where
    Frame.rotate turns x[i] with x[i + rotary_dim / 2]. The pairs are gathered into
    those halves first, (x0, x2, ..., x1, x3, ...), and the rotated features stay in
    that order: queries and keys alike, so their dot products are the pairs' (and keys
    are cached in it), and the rotation is Frame.rotate's (one native call a step)."""
    rotary_dim = frame.cos.shape[-1]
    # [..., rotary_dim] -> [..., rotary_dim / 2, 2] -> [..., 2, rotary_dim / 2]
    halves = x[..., :rotary_dim].unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    if rotary_dim < x.shape[-1]:
        halves = torch.cat((halves, x[..., rotary_dim:]), dim=-1)
    return frame.rotate(halves)


def query_temperature(positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """Llama 4's attention temperature (Ministral 3, Mistral 4, Mistral Large 3): the
    factor [B, 1, T, 1] on the queries at positions [B, T], 1 + beta * log(1 + floor(p /
    length)), so 1 within the first `length` positions."""
    steps = torch.floor(positions.float() / length)
    return (1 + beta * torch.log1p(steps))[:, None, :, None]


def attention_mask(
    positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, L]: query at position p sees keys at positions <= p
    (and > p - sliding_window). None when every query sees every key."""
    q = positions[:, :, None]
    k = key_positions[:, None, :]
    if q.shape[1] == 1 and sliding_window is None and positions.shape[0] == 1:
        return None
    mask = k <= q
    if sliding_window is not None:
        mask &= q - k < sliding_window
    return mask[:, None]


def reference_window_mask(
    positions: torch.Tensor, key_positions: torch.Tensor, prompt_ends: torch.Tensor, window: int
) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, L] of reference sliding-window attention (Unlimited-OCR's):
    query at position p of row b sees keys at positions <= p that are in its prompt
    (< prompt_ends[b]) or among the last `window` (> p - window). None when that hides
    nothing the causal mask shows (no query is `window` past its prompt)."""
    ends = prompt_ends.to(positions.device)[:, None, None]
    q = positions[:, :, None]
    if not bool((q - window >= ends).any()):
        return None
    k = key_positions[:, None, :]
    return ((k <= q) & ((k < ends) | (q - k < window)))[:, None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    frame: Frame,
    cache: KVCache | None,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA over the KV cache.

    q [B, H, T, D], k/v [B, Hkv, T, D] for the new tokens; returns [B, T, H*D].
    """
    batch, heads, tokens, head_dim = q.shape
    if cache is not None and cache.paged:
        return attend_paged(q, k, v, layer, frame, cache, None)
    if frame.static:
        k, v = cache.update_static(layer, k, v, frame.positions, frame.length)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=frame.mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
    # One query per head attending to every cached key (decoding): cheaper than SDPA's
    # kernel launch for a single row, and it reads the keys and values as stored; so does
    # a prompt's causal attention on the CPU (ops.attend_prompt).
    decode = tokens == 1 and frame.mask is None
    prompt = frame.prompt if tokens > 1 else None
    if cache is not None:
        k, v = cache.update(
            layer, k, v, frame.positions, frame.start, frame.length, decode or bool(prompt)
        )
    if decode:
        return ops.attend_one(q, k, v)
    if prompt:
        out = attend_prompt_rows(q, k, v, prompt)
        if out is not None:
            return out
        k, v = ops.stored_values(k, q.dtype), ops.stored_values(v, q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=frame.mask, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


def attend_scaled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    frame: Frame,
    cache: KVCache | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """attend() with a given score scale, optional tanh soft-capping of the scores
    (softcap * tanh(scores / softcap), before the mask) and windowed layers whose
    cache keeps only the window (frame.plan). Returns [B, T, H*D]."""
    if cache is not None and cache.paged:
        return attend_paged(q, k, v, layer, frame, cache, scale, softcap)
    prompt = frame.prompt if q.shape[2] > 1 else None
    k, v = cached_keys_values(k, v, layer, frame, cache, q.shape[2], bool(prompt))
    if prompt:
        out = attend_prompt_rows(q, k, v, prompt, scale, softcap)
        if out is not None:
            return out
        k, v = ops.stored_values(k, q.dtype), ops.stored_values(v, q.dtype)
    return attention(q, k, v, frame.mask, scale, softcap)


def attend_prompt_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prompt: PromptRows,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """ops.attend_prompt row by row (frame.prompt): q [B, H, T, D] over k/v [B, Hkv, L,
    D] (as stored); a padded query (past its row's count, at the row's last position)
    gets that position's output. Returns [B, T, H*D], or None where the kernel cannot
    take a row (the caller goes to torch)."""
    batch, heads, tokens, head_dim = q.shape
    if batch == 1:
        return ops.attend_prompt(q, k, v, prompt.starts[0], scale, softcap, prompt.window, sinks)
    out = q.new_empty(batch, tokens, heads * head_dim)
    for b, (start, count) in enumerate(zip(prompt.starts, prompt.counts, strict=True)):
        keys, values = k[b : b + 1, :, : start + count], v[b : b + 1, :, : start + count]
        y = ops.attend_prompt(
            q[b : b + 1, :, :count], keys, values, start, scale, softcap, prompt.window, sinks
        )
        if y is None:
            return None
        out[b, :count] = y[0]
        out[b, count:] = y[0, -1]
    return out


def cached_keys_values(
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    frame: Frame,
    cache: KVCache | None,
    tokens: int,
    stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's new keys and values k/v [B, Hkv, T, D] stored in a (not paged) cache,
    and those its `tokens` queries attend to, in frame.mask's order: the new ones alone
    without a cache; as the cache stores them where one query attends to every key
    (attention() then takes ops.attend_one, which reads them so) or with `stored` (for
    ops.attend_prompt)."""
    if cache is None:
        return k, v
    stored = stored or (tokens == 1 and frame.mask is None)
    if frame.plan is not None:
        return cache.update_window(layer, k, v, frame.plan, stored)
    return cache.update(layer, k, v, frame.positions, frame.start, frame.length, stored)


def attend_paged(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: int,
    frame: Frame,
    cache: PagedView,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """attend_scaled over a paged cache: a decode step reads the blocks in place where
    the native kernel can, anything else attends to them gathered (llmrun.models.paged;
    a prompt's rows as stored, through ops.attend_prompt). k/v None: nothing to
    write, the queries attend to what `layer` holds (a layer that shares an earlier
    layer's keys and values, as Gemma 3n's last layers do)."""
    if k is not None:
        cache.write(layer, k, v, frame.positions)
    out = cache.attend_one(layer, q, frame.positions, frame.mask, scale, softcap)
    if out is not None:
        return out
    prompt = frame.prompt if q.shape[2] > 1 else None
    keys, values = cache.read(layer, frame.length, q.dtype, bool(prompt))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if prompt:
        out = attend_prompt_rows(q, keys, values, prompt, scale, softcap)
        if out is not None:
            return out
        keys, values = ops.stored_values(keys, q.dtype), ops.stored_values(values, q.dtype)
    return attention(q, keys, values, frame.mask, scale, softcap)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask) v with GQA: q [B, H, T, D], k/v [B, Hkv, L, D],
    mask [B, 1, T, L] (True: attend) or None; returns [B, T, H*D]."""
    batch, heads, tokens, head_dim = q.shape
    if tokens == 1 and mask is None:
        return ops.attend_one(q, k, v, scale, softcap)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != k.shape[1]
        )
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
    groups, length = k.shape[1], k.shape[2]
    # [B, H, T, D] -> [B, Hkv, H/Hkv * T, D]: each KV head serves its query heads.
    grouped = q.reshape(batch, groups, heads // groups * tokens, head_dim)
    scores = (grouped @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, groups, heads // groups, tokens, length)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = weights.view(batch, groups, heads // groups * tokens, length) @ v
    # [B, Hkv, H/Hkv * T, D] -> [B, T, H*D]
    return out.view(batch, heads, tokens, head_dim).transpose(1, 2).reshape(batch, tokens, -1)


def alibi_slopes(heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi's slope per head (Press et al.), as BLOOM, MPT and llama.cpp give them: with
    n the largest power of 2 not above `heads`, 2^(-max_bias * h / n) for h = 1 .. n, then
    2^(-max_bias * (2j - 1) / 2n) for the remaining heads j = 1, 2, ... (f32 [heads])."""
    n = 2 ** math.floor(math.log2(heads))
    first = [2 ** (-max_bias * h / n) for h in range(1, n + 1)]
    rest = [2 ** (-max_bias * (2 * j - 1) / (2 * n)) for j in range(1, heads - n + 1)]
    return torch.tensor(first + rest, dtype=torch.float32, device="cpu")


class Alibi:
    """Mixed in before the CausalLM of a family with ALiBi (BLOOM, MPT), whose args give
    `alibi_slopes()` and whose body has no RoPE tables: each frame's mask is the
    attention's additive bias [B, H, T, L], slope_h * (key - query) for the keys a query
    sees and -inf for the others, which its attention takes through attend_biased.
    Per-query offsets leave the softmax as it is, so this is transformers' bias (BLOOM's
    slope * key, MPT's slope * (key - last)) and llama.cpp's (-slope * |query - key|),
    its values kept small for long sequences."""

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        keys = key_positions(positions, length, cache)
        # [B, T] and [B, L] -> [B, 1, T, L]
        distance = (keys[:, None, None, :] - positions[:, None, :, None]).float()
        slopes = self.args.alibi_slopes().to(positions.device)
        bias = slopes[None, :, None, None] * distance
        mask = bias.masked_fill(distance > 0, float("-inf")).to(dtype)
        no_rope = positions.new_zeros(0, dtype=dtype)
        return Frame(positions, start, length, mask, no_rope, no_rope)


def attend_biased(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    frame: Frame,
    cache: KVCache | PagedView | None,
    scale: float,
) -> torch.Tensor:
    """Attention with frame.mask an additive float bias [B, H, T, L] (Alibi's): the new
    q [B, H, T, D], k/v [B, Hkv, T, D] written to the cache, contiguous or paged, and the
    queries attending to every key the bias gives; returns [B, T, H*D]. The native
    one-query kernels take no bias, so a decode step attends through SDPA too."""
    if cache is not None and cache.paged:
        cache.write(layer, k, v, frame.positions)
        k, v = cache.read(layer, frame.length, q.dtype)
    else:
        k, v = cached_keys_values(k, v, layer, frame, cache, q.shape[2])
    return attention(q, k, v, frame.mask, scale)


def learned_positions(positions: torch.Tensor, table: int) -> torch.Tensor:
    """positions, checked to have a row in a learned position table of `table` rows
    (GPT-2's, GPT-BigCode's): past it, the model has no embedding to give."""
    # A CUDA graph being captured cannot read a position back (static decode).
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not capturing and int(positions.max()) >= table:
        raise ContextOverflowError(
            f"position {int(positions.max())} is past the model's {table} learned positions"
        )
    return positions


def key_positions(positions: torch.Tensor, length: int, cache: KVCache | None) -> torch.Tensor:
    """Positions of the keys attended to: the cache prefix up to the newest token,
    or, without a cache, the new tokens themselves."""
    if cache is None:
        return positions
    return torch.arange(length, device=positions.device).expand(positions.shape[0], length)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the SwiGLU feed-forward of the Llama family."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        bias = getattr(args, "mlp_bias", False)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=bias)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gated(self.act, self.gate_proj(x), self.up_proj(x)))


# ---- mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) ----------------------------------


def check_top_k(top_k: int, experts: int, field: str | None = None) -> None:
    """Refuse a config whose tokens would take no experts or more than there are
    (`field`: the config's name for the experts' count, named in the message)."""
    if not 0 < top_k <= experts:
        named = f" ({field})" if field else ""
        raise ModelFormatError(
            f"num_experts_per_tok is {top_k}, but there are {experts} experts{named}"
        )


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights, as transformers' routers choose
    them: softmax over the router's logits [N, E] in f32, the top_k by torch.topk (so
    ties go the same way), renormalized to sum to 1 when `normalize` (Mixtral's
    top-k-then-softmax is the same thing). Returns weights [N, top_k] in the logits'
    dtype and expert indices [N, top_k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), indices


def route_grouped(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "max",
    normalize: bool = False,
    scale: float = 1.0,
    masked: float = float("-inf"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers (V2's greedy and group_limited_greedy, V3's noaux_tc, and the
    families that copy V3's), as transformers computes them: scores are the softmax or
    the sigmoid (`scoring`) of the logits [N, E], in f32; experts are chosen by score +
    `bias` (V3's e_score_correction_bias), only among the topk_group of n_group equal
    groups that score highest (`group_score` "max": a group's best choice score, V2;
    "top2": the sum of its best two, V3), the others' choice scores set to `masked`
    (A.X K2's 0: one of them then beats a kept expert whose biased score is below
    zero). A chosen expert weighs its unbiased score,
    renormalized over the top_k (+1e-20) when `normalize`, times `scale`
    (routed_scaling_factor). Returns f32 weights [N, top_k] and indices [N, top_k]."""
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        # [N, E] -> [N, groups, E / groups]
        grouped = choice.view(choice.shape[0], n_group, -1)
        if group_score == "max":
            best = grouped.amax(dim=-1)
        else:
            best = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(best, dtype=torch.bool)
        kept.scatter_(1, torch.topk(best, topk_group, dim=-1).indices, True)
        hidden = ~kept[..., None].expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(hidden, masked)
    indices = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, indices


class TopKExperts(nn.Module):
    """Each token through the top_k of `count` experts (`expert()` builds one) by its
    router's (`gate`) softmax, weighted by their probabilities, renormalized where
    norm_topk_prob (route, mix_experts): Mixtral's block and the Qwen MoEs'."""

    def __init__(
        self, args: Any, count: int, expert: Callable[[], nn.Module], norm_topk_prob: bool
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, count, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, D] -> [B*T, D] and back
        return self.routed(x.reshape(-1, x.shape[-1])).view(x.shape)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum [N, D] for tokens x [N, D]."""
        weights, indices = route(self.gate(x), self.top_k, self.norm_topk_prob)
        return mix_experts(x, weights, indices, self.experts)


def mix_experts(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """sum_k weights[n, k] * experts[indices[n, k]](x[n]) for x [N, D]: each chosen
    expert runs once on all of its tokens (a prompt chunk or a batch reads its weights
    once), the others not at all. Every token sums its experts in ascending expert
    order, one token alone or among others, so a batch gives each row what it gets
    alone. A loader may give `experts` a `mix(x, weights, indices)` that computes the
    same faster where it can (None where it cannot): llmrun.quant.experts."""
    fused = getattr(experts, "mix", None)
    if fused is not None:
        out = fused(x, weights, indices)
        if out is not None:
            return out
    tokens, top_k = indices.shape
    if tokens == 1:  # decoding: no grouping to do
        out = None
        for e, w in sorted(zip(indices[0].tolist(), weights[0].tolist(), strict=True)):
            y = experts[e](x) * w
            out = y if out is None else out + y
        return out
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    rows = order // top_k
    scales = weights.reshape(-1, 1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=len(experts)).tolist()):
        if count:
            chosen = rows[start : start + count]
            y = experts[e](x.index_select(0, chosen)) * scales[start : start + count]
            out.index_add_(0, chosen, y)
            start += count
    return out


def run_layers(
    model: nn.Module, x: torch.Tensor, frames: Any, cache: KVCache | None
) -> torch.Tensor:
    """x through the model's decoder layers (model.model.layers), each given `frames`
    (a Frame, or a family's dict of them) and the cache. A loader may give the model a
    `decode_step(x, frames, cache)` that runs the whole stack at once where it can (None
    where it cannot): llmrun.quant.decode_step."""
    step = model.decode_step
    if step is not None:
        out = step(x, frames, cache)
        if out is not None:
            return out
    for layer in model.model.layers:
        x = layer(x, frames, cache)
    return x


# The hidden states that head_logits hands to final_hidden_states, per thread: serve's
# scheduler may run the same model for logits on its own thread meanwhile.
_HIDDEN = threading.local()


def head_logits(
    model: nn.Module,
    x: torch.Tensor,
    frames: Any,
    cache: KVCache | None,
    last_only: bool = False,
    last: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, T, hidden] through the decoder layers (run_layers), the final norm
    (model.model.norm) and the output matrix (model.lm_head): logits [B, T, vocab],
    [B, 1, vocab] with last_only (each row's last token) or `last` [B] (each row's last
    real token). Where the decode step takes one token per row, it runs the norm and
    the output matrix in the same native call (f32 logits). In a thread taking hidden
    states (final_hidden_states), the final norm's output instead, every token's."""
    captured = getattr(_HIDDEN, "states", None)
    if captured is not None:
        x = model.model.norm(run_layers(model, x, frames, cache))
        captured.append(x)
        return x
    step = model.decode_step
    if step is not None and x.shape[1] == 1:
        taken = step(x, frames, cache, head=True)
        if taken is not None:
            x, logits = taken
            if logits is not None:
                return logits
        else:
            x = run_layers(model, x, frames, cache)
    else:
        x = run_layers(model, x, frames, cache)
    if last is not None:
        x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
    elif last_only:
        x = x[:, -1:]
    return model.lm_head(model.model.norm(x))


def final_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Float32 final hidden states [B, T, hidden] of input_ids [B, T] at positions [B, T],
    rows padded on the right beyond `lengths` [B] (causal attention keeps the padding out
    of the real tokens' states): the model's own forward, without a cache, up to its final
    norm, the output matrix and what follows it skipped (see head_logits). A model whose
    forward does not end in head_logits is refused rather than given states it may not
    compute so."""
    captured: list[torch.Tensor] = []
    _HIDDEN.states = captured
    try:
        model(input_ids, positions)
    finally:
        _HIDDEN.states = None
    if len(captured) != 1:
        raise UnsupportedError(
            f"{type(model).__module__.rpartition('.')[2]}: hidden states for embeddings are "
            "not supported for this family"
        )
    return captured[0].float()


def new_cache(args: Any, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
    """A KV cache for a model of `args`: its head width (`cache_head_dim` where keys and
    values are cached wider than the RoPE width, as MLA does), and each layer's sliding
    window where the family has some (`layer_windows`)."""
    windows = args.layer_windows() if hasattr(args, "layer_windows") else None
    return KVCache(
        args.num_hidden_layers,
        batch,
        args.num_key_value_heads,
        max_seq_len,
        getattr(args, "cache_head_dim", args.head_dim),
        dtype,
        device,
        windows=windows,
        values_are_keys=getattr(args, "cache_values_are_keys", False),
    )


def layer_frames(
    positions: torch.Tensor,
    cache: KVCache | None,
    dtype: torch.dtype,
    window: int | None,
    rotary: RotaryEmbedding,
    local_rotary: RotaryEmbedding | None = None,
    last: torch.Tensor | None = None,
) -> dict[str, Frame]:
    """A Frame per layer type: "full_attention" layers see every earlier position,
    "sliding_attention" ones the last `window` (in a cache that keeps only those: its
    plan). The sliding layers turn by `local_rotary` where they have a RoPE of their own."""
    start, length = int(positions[0, 0]), int(positions.max()) + 1
    # One row's decode step attends to every key it has: no mask to build.
    one = positions.shape == (1, 1)
    mask = None if one else attention_mask(positions, key_positions(positions, length, cache))
    capacity = cache.max_seq_len if cache is not None else None

    def angles(embedding: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = embedding(positions, capacity)
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        return cos[:, None].to(dtype), sin[:, None].to(dtype)

    cos, sin = angles(rotary)
    full = Frame(positions, start, length, mask, cos, sin)
    if local_rotary is not None:
        cos, sin = angles(local_rotary)
    if cache is not None and cache.window is not None:
        plan = cache.plan_window(positions, last)
        local = Frame(positions, start, length, plan.mask, cos, sin, plan)
    else:
        # Within one window of position 0 the window hides nothing.
        if window is not None and length > window:
            keys = key_positions(positions, length, cache)
            mask = attention_mask(positions, keys, window)
        local = Frame(positions, start, length, mask, cos, sin)
    return {"full_attention": full, "sliding_attention": local}


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: Any, layer: int, attention: type, mlp: type) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = mlp(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, frame: Frame, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), frame, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """The embedding, the decoder layers, the final norm (RMSNorm unless `norm` is given)
    and the RoPE tables."""

    def __init__(
        self,
        args: Any,
        attention: type,
        mlp: type,
        layer: type = DecoderLayer,
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            layer(args, i, attention, mlp) for i in range(args.num_hidden_layers)
        )
        self.norm = norm if norm is not None else RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rope_parameters, args.head_dim, args.max_position_embeddings
        )


class CausalLM(nn.Module):
    """embed -> decoder layers -> norm -> lm_head, with HF's module names
    (`model.layers.N.self_attn.q_proj`, `lm_head`, ...). A family supplies its
    attention and MLP classes, its decoder layer where the norms sit elsewhere
    (OLMo 2's after each sublayer), and its body where the modules are named otherwise
    (LFM2's final norm)."""

    decode_step = None  # see run_layers
    generates = True  # a language model (encoders for embeddings alone say False)

    def __init__(
        self,
        args: Any,
        attention: type,
        mlp: type,
        layer: type = DecoderLayer,
        norm: nn.Module | None = None,
        body: type = Body,
    ) -> None:
        super().__init__()
        self.args = args
        self.model = body(args, attention, mlp, layer, norm)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        last: torch.Tensor | None = None,
        static: int | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """Float32 logits [B, T, vocab] for input_ids [B, T] at positions [B, T];
        [B, 1, vocab] with last_only (the last token of each row) or with `last`
        [B] (the index of each row's last real token, for rows padded on the right).
        `static`: one token of one sequence, attending to the cache's first `static`
        positions through a mask (llmrun.static_decode). `images`: image tokens
        (llmrun.models.gemma3.ImageTokens, one row) in place of their placeholders, seen
        causally as text is (Mistral 3's)."""
        if images is not None:  # placeholder ids may lie past the vocabulary
            input_ids = input_ids.masked_fill(images.groups >= 0, 0)
        x = self.embed_at(input_ids, positions)
        if images is not None:
            x = images.place(x)
        if static is not None:
            frame = self.static_frame(positions, cache, x.dtype, static)
        else:
            frame = self.frame(positions, cache, x.dtype, last)
        return head_logits(self, x, frame, cache, last_only, last).float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Float32 final hidden states [B, T, hidden] (see final_hidden_states)."""
        return final_hidden_states(self, input_ids, positions, lengths)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, hidden] of input_ids [B, T] (Granite scales them)."""
        return self.model.embed_tokens(input_ids)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input embeddings of input_ids [B, T] at positions [B, T]: embed()'s, for
        every family but those with learned absolute positions (GPT-2)."""
        return self.embed(input_ids)

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame | dict[str, Frame]:
        """What the layers need of this forward's tokens (a Frame per layer type, for a
        family whose windowed layers keep only their window: `last` places the rows'
        writes in those rings, see layer_frames)."""
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        window = getattr(self.args, "sliding_window", None)
        mask = attention_mask(positions, key_positions(positions, length, cache), window)
        cos, sin = self.model.rotary_emb(
            positions, cache.max_seq_len if cache is not None else None
        )
        # [B, T, rotary_dim] -> [B, 1, T, rotary_dim], broadcast over heads
        return Frame(positions, start, length, mask, cos[:, None].to(dtype), sin[:, None].to(dtype))

    def static_frame(
        self, positions: torch.Tensor, cache: KVCache, dtype: torch.dtype, length: int
    ) -> Frame:
        """The Frame of a static decode step: the cache's first `length` positions as
        keys, those past the position (or outside a sliding window) masked, computed on
        the device."""
        keys = torch.arange(length, device=positions.device)[None, None]
        query = positions[:, :, None]
        mask = keys <= query
        window = getattr(self.args, "sliding_window", None)
        if window is not None:
            mask &= query - keys < window
        cos, sin = self.model.rotary_emb(positions, cache.max_seq_len)
        return Frame(
            positions, 0, length, mask[:, None], cos[:, None].to(dtype),
            sin[:, None].to(dtype), static=True,
        )  # fmt: skip

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.args, batch, max_seq_len, dtype, device)


class LayerTypes:
    """Mixed in before the CausalLM of a family whose layers are "full_attention" or
    "sliding_attention" (args.layer_types, args.sliding_window): a Frame per layer type
    (layer_frames), the sliding layers' in a cache that keeps only their window, turned
    by a RoPE of their own where the body has one (model.rotary_emb_local)."""

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> dict[str, Frame]:
        return layer_frames(
            positions,
            cache,
            dtype,
            self.args.sliding_window,
            self.model.rotary_emb,
            getattr(self.model, "rotary_emb_local", None),
            last=last,
        )


class Hybrid:
    """Mixed in before the CausalLM of a hybrid model (llmrun.models.recurrent), whose
    args list its attention layers (`attention_layers`, in order) and its recurrent
    layers' state (`recurrent_shapes()`): the KV cache holds the attention layers alone
    and every recurrent layer's state, in float32 as llama.cpp keeps it; each frame
    carries the rows' real token counts (RecurrentState.begin, once per forward)."""

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        frame = super().frame(positions, cache, dtype, last)
        if cache is not None and cache.recurrent is not None:
            frame.counts = cache.recurrent.begin(positions)
        return frame

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        args = self.args
        # MLA's latent (Kimi Linear): one head of its own width, the values its keys.
        cache = KVCache(
            len(args.attention_layers), batch, args.num_key_value_heads, max_seq_len,
            getattr(args, "cache_head_dim", args.head_dim), dtype, device,
            values_are_keys=getattr(args, "cache_values_are_keys", False),
        )  # fmt: skip
        cache.recurrent = RecurrentState(args.recurrent_shapes(), batch, torch.float32, device)
        return cache


class StateOnlyArgs:
    """Mixed into the args of a model with no attention (Mamba, RWKV, xLSTM): a KV cache
    of no layers, as llmrun.models.kv_cache_bytes and the server's pool read one."""

    @property
    def attention_layers(self) -> list[int]:
        return []

    @property
    def num_key_value_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return 1

    def layer_windows(self) -> list[None]:
        return []


class StateOnly:
    """Mixed in before the CausalLM of a model with no attention, whose args are
    StateOnlyArgs with `recurrent_shapes()`: the KV cache holds no layers, only every
    layer's state in float32; each frame (of type `frame_type`) carries the rows' real
    token counts (RecurrentState.begin) and no mask or RoPE, as nothing attends."""

    frame_type: type[Frame] = Frame

    def frame(
        self,
        positions: torch.Tensor,
        cache: KVCache | None,
        dtype: torch.dtype,
        last: torch.Tensor | None = None,
    ) -> Frame:
        start, length = int(positions[0, 0]), int(positions.max()) + 1
        none = positions.new_zeros(0, dtype=dtype)
        frame = self.frame_type(positions, start, length, None, none, none)
        if cache is not None:
            if cache.recurrent is None:
                raise RuntimeError(
                    f"{type(self).__module__} needs a cache with its state (the model's new_cache)"
                )
            frame.counts = cache.recurrent.begin(positions)
        return frame

    def new_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        cache = KVCache(0, batch, 1, max_seq_len, 1, dtype, device)
        cache.recurrent = RecurrentState(self.args.recurrent_shapes(), batch, torch.float32, device)
        return cache
