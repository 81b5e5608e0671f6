"""Preallocated KV cache: one static buffer per layer, written at token positions.

Static shapes keep allocation off the per-token path and let torch.compile and
CUDA graphs apply. Each batch row is an independent sequence (a serving slot);
a row's entries past its current position are stale and masked out, so
keeping a shared prefix is just a matter of writing from where it ends.

Sliding-window layers (Gemma 2/3) keep only their window, as llama.cpp's SWA
cache does: a ring of `window` slots per row, position p in slot p % window.
A query at position q sees keys q - window + 1 .. q, so after writing q the
ring holds exactly what q needs. A ring cannot roll back as far as a full
buffer can: writing past position n overwrites keys that a continuation from
n would need. Each row therefore remembers where its last write ended, a
continuation that would read overwritten keys is refused (reusable() says how
much of a prefix survives; the caller re-prefills the rest), and nothing ever
attends to a key from another sequence.

Layers may differ in shape (Gemma 4: sliding layers with 16 KV heads of 256, full ones
with 4 of 512): each layer is stored in its own (KV heads, head_dim), as llama.cpp stores
it. Layers of one shape and kind (full or ring) share one buffer, so a model whose
layers are alike has one buffer of full layers and one of rings, as before.

Keys and values are stored in the compute dtype, or in a cache type of their own
(--cache-type: f32, f16, bf16, or q8_0, llama.cpp's blocks of 32 int8 with an f16
scale along head_dim). Each token's keys and values convert once, when written
(rounded to nearest even; q8_0 quantized as gguf does). Single-query decoding reads
the stored form itself (llmrun.ops.attend_one); everything else (prefill, batches,
GPU) gets the span it attends to dequantized to the compute dtype, so a prefill over
a q8_0 or f16 cache dequantizes the cached prefix once per chunk and layer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmrun import ops
from llmrun.errors import UnsupportedError
from llmrun.models.recurrent import RecurrentState

# --cache-type names: the storage dtype (q8_0: uint8 rows of Q8_0 blocks) and the bytes
# one value takes (Q8_0: 34 bytes per 32 values).
CACHE_TYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "q8_0": torch.uint8,
}
BYTES_PER_VALUE: dict[str, float] = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}


def cache_type_name(dtype: torch.dtype | str) -> str:
    """The cache type a KVCache `dtype` argument stores ("f32", ..., or the dtype's name)."""
    if isinstance(dtype, str):
        return dtype
    names = {d: name for name, d in CACHE_TYPES.items() if name != "q8_0"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class WindowPlan:
    """How one forward's tokens meet the windowed layers' rings, worked out once
    per forward (KVCache.plan_window) and used by every windowed layer."""

    decode: bool  # one token per row: written to the ring first, then the ring attended
    starts: list[int]  # each row's first position
    counts: list[int]  # each row's real tokens; the rest (right padding) is never stored
    with_ring: bool  # prefill: whether any row has earlier keys in the ring to attend to
    mask: torch.Tensor | None  # [B, 1, T, keys]; None: every key attended (one row, decode)
    keys: int  # one-row decode without a mask: the ring slots holding keys (the first `keys`)
    # One row's prefill with earlier keys: how many (its last `window` positions at most),
    # taken from the ring in position order; 0: the ring in slot order (several rows)
    in_order: int = 0


def cache_bytes(
    shapes: Sequence[tuple[int, int]],
    windows: Sequence[int | None],
    context: int,
    bytes_per_value: float,
    values_are_keys: bool = False,
) -> int:
    """Bytes of keys and values a KVCache of `context` positions holds for layers of these
    (KV heads, head_dim) shapes and sliding windows (None: a full layer): a windowed layer
    keeps at most its window. bytes_per_value: BYTES_PER_VALUE of the cache type (q8_0:
    34 / 32). `values_are_keys`: the values are stored as the keys, once (see KVCache)."""
    copies = 1 if values_are_keys else 2
    return sum(
        round(copies * heads * head_dim * bytes_per_value)
        * (context if w is None else min(w, context))
        for (heads, head_dim), w in zip(shapes, windows, strict=True)
    )


def _unpadded(
    rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The index write of k/v [B, Hkv, T, D] at rows [B, 1] and positions [B, T], as
    (rows, positions, k, v) with k/v [..., Hkv, D]: without the padding of rows padded on
    the right (tokens that repeat the position before them), whose keys would overwrite
    the real token's where they differ from it (a hybrid model's recurrent layers give
    padded tokens states of their own)."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if positions.shape[1] == 1:
        return rows, positions, k, v
    real = torch.ones_like(positions, dtype=torch.bool)
    real[:, 1:] = positions[:, 1:] != positions[:, :-1]
    if bool(real.all()):
        return rows, positions, k, v
    return rows.expand_as(positions)[real], positions[real], k[real], v[real]


class KVCache:
    paged = False  # llmrun.models.paged.PagedView is the paged one
    # A hybrid model's recurrent layers keep their state here (llmrun.models.recurrent);
    # its attention layers are this cache's layers.
    recurrent: RecurrentState | None = None
    # M-RoPE (llmrun.models.mrope): from each (position, shift) on, one row's tokens turn
    # by position + shift, where images before them took fewer positions than tokens.
    rope_shifts: tuple[tuple[int, int], ...] = ()
    # Reference sliding-window attention (Unlimited-OCR, llmrun.models.deepseek): each
    # row's prompt length [B], which the generation loop sets per prompt, and the
    # model's window; None: full attention.
    prompt_ends: torch.Tensor | None = None
    reference_window: int | None = None

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: torch.device | str,
        windows: Sequence[int | None] | None = None,
        values_are_keys: bool = False,
        shapes: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """`dtype`: what keys and values are stored as, a torch dtype or a cache type
        name (CACHE_TYPES). `windows`: per layer, its sliding window or None (a full
        layer). A window that is not shorter than max_seq_len needs no ring: that
        layer is full here. `values_are_keys`: the model's values are its keys (MLA
        attends to its cached latent as both), so they share one buffer: the values
        written are the keys again, and memory is taken once. `shapes`: per layer, its
        (KV heads, head_dim) where layers differ; by default every layer's is
        (n_kv_heads, head_dim)."""
        shapes = list(shapes) if shapes is not None else [(n_kv_heads, head_dim)] * n_layers
        if len(shapes) != n_layers:
            raise ValueError(f"{len(shapes)} layer shapes for {n_layers} layers")
        if isinstance(dtype, str):
            if dtype not in CACHE_TYPES:
                raise UnsupportedError(
                    f"unknown KV cache type {dtype!r} (choose from {', '.join(CACHE_TYPES)})"
                )
            odd = sorted({d for _, d in shapes if d % ops.Q8_0_BLOCK})
            if dtype == "q8_0" and odd:
                raise UnsupportedError(
                    f"a q8_0 KV cache needs head_dim to be a multiple of 32 (its blocks of "
                    f"32 values run along head_dim); this model's is {odd[0]}: use "
                    "--cache-type f16 or bf16"
                )
        self.cache_type = cache_type_name(dtype)
        self.quantized = self.cache_type == "q8_0"
        storage = CACHE_TYPES[dtype] if isinstance(dtype, str) else dtype
        self.storage = storage
        windows = list(windows) if windows is not None else [None] * n_layers
        self.windows = windows
        ring = [w is not None and w < max_seq_len for w in windows]
        sizes = {w for w, r in zip(windows, ring, strict=True) if r}
        if len(sizes) > 1:
            raise ValueError(f"one window size per cache, got {sorted(sizes)}")
        self.window: int | None = sizes.pop() if sizes else None
        self.ring_layers = tuple(ring)
        self.shapes = shapes
        self.uniform = len(set(shapes)) == 1  # one shape: the native decode step's kind
        # One buffer per kind (full or ring) and shape; the first is always a full one
        # (of no layers where every layer is a ring, or where there are none: Mamba's
        # cache holds its state alone), so self.k is one.
        full = [s for s, r in zip(shapes, ring, strict=True) if not r]
        kinds = [(False, full[0] if full else shapes[0] if shapes else (n_kv_heads, head_dim))]
        kinds += [
            (r, s) for r, s in dict.fromkeys(zip(ring, shapes, strict=True)) if (r, s) != kinds[0]
        ]
        # Each layer's buffer and its index there.
        self.where: list[tuple[int, int]] = []
        counts = [0] * len(kinds)
        for r, s in zip(ring, shapes, strict=True):
            group = kinds.index((r, s))
            self.where.append((group, counts[group]))
            counts[group] += 1
        self.index = [i for _, i in self.where]  # as the native decode step reads it
        self.values_are_keys = values_are_keys
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (r, (heads, dim)), layers in zip(kinds, counts, strict=True):
            # Stored values per row: head_dim, or Q8_0's bytes for head_dim values.
            width = dim // ops.Q8_0_BLOCK * ops.Q8_0_BYTES if self.quantized else dim
            shape = (layers, batch, heads, self.window if r else max_seq_len, width)
            k = torch.zeros(shape, dtype=storage, device=device)
            v = k if values_are_keys else torch.zeros(shape, dtype=storage, device=device)
            self.buffers.append((k, v))
        self.ring_buffers = [g for g, (r, _) in enumerate(kinds) if r]
        self._name_buffers()
        self.max_seq_len = max_seq_len
        self.rows: torch.Tensor | None = None  # slots of a non-contiguous select()
        self.row_list: list[int] = list(range(batch))  # this view's rows of its tensors
        self.base_rows: list[int] = list(range(batch))  # this view's rows of the allocation
        # Per allocation row, shared by every view: one past the last position written
        # to the rings (what a rollback may have overwritten).
        self.written: list[int] = [0] * batch

    def _name_buffers(self) -> None:
        """self.k/v: the first full buffer; self.ring_k/v: the first ring buffer (None
        without rings). A uniform cache has at most these two (what static and native
        decode steps read)."""
        self.k, self.v = self.buffers[0]
        self.ring_k = self.ring_v = None
        if self.ring_buffers:
            self.ring_k, self.ring_v = self.buffers[self.ring_buffers[0]]

    def select(self, slots: Sequence[int]) -> KVCache:
        """A view of the rows `slots`, in order: a forward with len(slots) rows
        reads and writes those slots, and no others, of this cache."""
        view = copy.copy(self)
        view.base_rows = [self.base_rows[s] for s in slots]
        first, count = slots[0], len(slots)
        if list(slots) == list(range(first, first + count)):
            view.buffers = []
            for k, v in self.buffers:
                rows_k = k[:, first : first + count]
                view.buffers.append((rows_k, rows_k if v is k else v[:, first : first + count]))
            view._name_buffers()
            view.row_list = list(range(count))
        else:
            view.rows = torch.tensor(list(slots), device=self.k.device)
            view.row_list = list(slots)
        if self.recurrent is not None:
            view.recurrent = self.recurrent.select(slots)
        return view

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Row i takes the keys and values row rows[i] held (beam search: each beam goes
        on from one of the last step's), for rows that all hold the same positions."""
        for k, v in self.buffers:
            k.copy_(k.index_select(1, rows))
            if v is not k:
                v.copy_(v.index_select(1, rows))

    @property
    def nbytes(self) -> int:
        copies = 1 if self.values_are_keys else 2
        states = self.recurrent.nbytes if self.recurrent is not None else 0
        return copies * sum(k.nbytes for k, _ in self.buffers) + states

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """The layer's KV heads and stored row width (head_dim, or its Q8_0 bytes)."""
        _, _, heads, _, width = self.buffers[self.where[layer][0]][0].shape
        return heads, width

    def position_bytes(self, layers: Sequence[int] | None = None) -> int:
        """Bytes one position's keys and values take in these layers (default: all)."""
        layers = range(len(self.shapes)) if layers is None else layers
        copies = 1 if self.values_are_keys else 2
        size = self.k.element_size()
        return copies * sum(math.prod(self.layer_shape(i)) * size for i in layers)

    def windowed(self, layer: int) -> bool:
        """Whether `layer` keeps only its window (a ring) here."""
        return self.ring_layers[layer]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [..., D] as this cache stores them (as they are when that is
        their dtype already)."""
        if self.quantized:
            return ops.quantize_q8_0(x)
        return x if x.dtype == self.storage else x.to(self.storage)

    def decode(self, x: torch.Tensor, dtype: torch.dtype, stored: bool = False) -> torch.Tensor:
        """Stored keys or values in the compute `dtype`, or as stored with `stored`."""
        return x if stored else ops.stored_values(x, dtype)

    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        first: int,
        length: int,
        stored: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, Hkv, T, D] at positions [B, T] (whose first is `first` and
        maximum `length` - 1); return the keys and values of positions
        0 .. length - 1 for every row, in k's dtype, or with `stored` as the cache
        holds them (for llmrun.ops.attend_one, which reads every storage type)."""
        batch, tokens = positions.shape
        (group, index), dtype = self.where[layer], k.dtype
        k_all, v_all = self.buffers[group]
        k, v = self.encode(k), self.encode(v)
        if self.rows is not None:
            # Scattered slots: index writes, and a gathered copy of their prefixes to attend to.
            k_layer, v_layer = k_all[index], v_all[index]
            rows, positions, k, v = _unpadded(self.rows[:, None], positions, k, v)
            k_layer[rows, :, positions] = k
            v_layer[rows, :, positions] = v
            keys, values = k_layer[self.rows, :, :length], v_layer[self.rows, :, :length]
            return self.decode(keys, dtype, stored), self.decode(values, dtype, stored)
        k_cache, v_cache = k_all[index], v_all[index]
        if batch != k_cache.shape[0]:
            k_cache, v_cache = k_cache[:batch], v_cache[:batch]
        if batch == 1 and length - first == tokens:
            # One sequence, contiguous positions: a plain slice write (narrow: one op
            # where indexing takes several, and decode does this per layer per token).
            k_cache.narrow(2, first, tokens).copy_(k)
            v_cache.narrow(2, first, tokens).copy_(v)
            keys, values = k_cache.narrow(2, 0, length), v_cache.narrow(2, 0, length)
            return self.decode(keys, dtype, stored), self.decode(values, dtype, stored)
        rows = torch.arange(batch, device=positions.device)[:, None]
        rows, positions, k, v = _unpadded(rows, positions, k, v)
        k_cache[rows, :, positions] = k
        v_cache[rows, :, positions] = v
        keys, values = k_cache[:, :, :length], v_cache[:, :, :length]
        return self.decode(keys, dtype, stored), self.decode(values, dtype, stored)

    def update_static(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A static decode step's update (llmrun.static_decode): one token of row 0,
        k/v [1, Hkv, 1, D], stored at positions [1, 1] (below `length`) without reading
        the position back to the host; returns the keys and values of positions
        0 .. length - 1 in k's dtype."""
        (group, index), dtype = self.where[layer], k.dtype
        k_all, v_all = self.buffers[group]
        k_cache, v_cache = k_all[index, :1], v_all[index, :1]
        k_cache.index_copy_(2, positions[0], self.encode(k))
        v_cache.index_copy_(2, positions[0], self.encode(v))
        keys, values = k_cache[:, :, :length], v_cache[:, :, :length]
        return self.decode(keys, dtype), self.decode(values, dtype)

    # ---- sliding-window layers ----------------------------------------------------------

    def _lost(self, start: int, written: int) -> bool:
        """Whether a row whose rings were last written up to `written` has lost keys
        that a continuation from position `start` needs (start - window + 1 ..
        start - 1). Position t >= window sits where t - window was, so the stale
        positions start .. written - 1 (a rollback) overwrote the needed ones exactly
        when some t in start + 1 .. start + window - 1 is among them and >= window.
        A start past `written` would read keys never stored."""
        if start > written:
            return True
        window = self.window
        return max(start + 1, window) < min(written, start + window)

    def reusable(self, n: int) -> int:
        """How many of the first n cached positions a continuation can keep: n, or
        0 when the windowed layers no longer hold what position n needs (a
        rollback overwrote it) or the recurrent layers' state is not that of the
        first n, so the prefix must be prefilled again; at most a reference window
        past the last prompt's end."""
        if self.recurrent is not None and n:
            n = self.recurrent.reusable(n)
        if self.reference_window is not None and self.prompt_ends is not None:
            # Past its prompt's end plus the window, a token's keys and values were computed
            # seeing only the window: not what the next prompt's prefill computes.
            n = min(n, int(self.prompt_ends.min()) + self.reference_window)
        if self.ring_k is None or n == 0:
            return n
        return 0 if any(self._lost(n, self.written[r]) for r in self.base_rows) else n

    def plan_window(self, positions: torch.Tensor, last: torch.Tensor | None = None) -> WindowPlan:
        """The plan for a forward of positions [B, T] (consecutive per row; with
        `last`, the index of each row's last real token, the rest padding). Refuses
        (RuntimeError) a row whose rings lost keys it would attend to, and records
        where each row's writes end."""
        batch, tokens = positions.shape
        window = self.window
        starts = positions[:, 0].tolist()
        counts = [tokens] * batch if last is None else (last + 1).tolist()
        for row, start, count in zip(self.base_rows, starts, counts, strict=True):
            if self._lost(start, self.written[row]):
                raise RuntimeError(
                    f"KV cache row {row}: the sliding-window layers no longer hold the keys "
                    f"position {start} attends to (written up to {self.written[row]}); "
                    "prefill the sequence again (KVCache.reusable says how much survives)"
                )
            self.written[row] = start + count
        if tokens == 1 and batch == 1:
            return WindowPlan(True, starts, counts, False, None, min(starts[0] + 1, window))
        slots = torch.arange(window, device=positions.device)
        if tokens == 1:
            # After the write, slot s holds the row's latest position q' <= q with
            # q' = s (mod window): none yet where that would be negative.
            held = positions - (positions - slots) % window  # [B, window]
            return WindowPlan(True, starts, counts, True, (held >= 0)[:, None, None], window)
        q = positions[:, :, None]
        mask = (positions[:, None, :] <= q) & (q - positions[:, None, :] < window)
        with_ring = any(s > 0 for s in starts)
        if with_ring and batch == 1:
            # The ring's keys in position order, start - in_order .. start - 1: with the
            # new ones after them, one sequence's keys in order (ops.attend_prompt's)
            in_order = min(starts[0], window)
            held = torch.arange(starts[0] - in_order, starts[0], device=positions.device)
            ring_mask = q - held < window  # [1, T, in_order]
            mask = torch.cat([ring_mask, mask], dim=-1)
            return WindowPlan(False, starts, counts, True, mask[:, None], 0, in_order)
        if with_ring:
            # Before the write, slot s holds the row's latest position p < start with
            # p = s (mod window), if any; a query sees it while within the window.
            start = positions[:, :1]
            held = start - 1 - (start - 1 - slots) % window  # [B, window]
            ring_mask = (held >= 0)[:, None, :] & (q - held[:, None, :] < window)
            mask = torch.cat([ring_mask, mask], dim=-1)
        return WindowPlan(False, starts, counts, with_ring, mask[:, None], 0)

    def update_window(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: WindowPlan,
        stored: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, Hkv, T, D] of a windowed layer as `plan` says and return the
        keys and values to attend to, in the order plan.mask describes: the ring
        (decode: after the write), or for a prefill the ring before it (when
        plan.with_ring) followed by the new tokens; in k's dtype, or with `stored` as
        the cache holds them (see update)."""
        (group, index), window, dtype = self.where[layer], self.window, k.dtype
        k_all, v_all = self.buffers[group]
        ring_k, ring_v = k_all[index], v_all[index]
        batch = k.shape[0]
        k, v = self.encode(k), self.encode(v)
        if plan.decode:
            keys, values = self._decode_window(ring_k, ring_v, k, v, plan)
            return self.decode(keys, dtype, stored), self.decode(values, dtype, stored)
        keys, values = k, v
        if plan.with_ring:
            old_k = ring_k[self.rows] if self.rows is not None else ring_k[:batch]
            old_v = ring_v[self.rows] if self.rows is not None else ring_v[:batch]
            if plan.in_order:  # position p sits in slot p % window
                start = plan.starts[0]
                slots = torch.arange(start - plan.in_order, start, device=k.device) % window
                old_k, old_v = old_k.index_select(2, slots), old_v.index_select(2, slots)
            keys, values = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        # The last `window` real tokens of each row go to the ring, in at most two
        # contiguous runs of slots (the run wraps at the end of the ring).
        for b, (start, count) in enumerate(zip(plan.starts, plan.counts, strict=True)):
            row, kept = self.row_list[b], min(count, window)
            first = count - kept  # index of the first token kept
            slot = (start + first) % window
            head = min(kept, window - slot)
            for ring, new in ((ring_k, k), (ring_v, v)):
                ring[row, :, slot : slot + head] = new[b, :, first : first + head]
                ring[row, :, : kept - head] = new[b, :, first + head : first + kept]
        # The new tokens too as stored, so a ring layer attends to what a full one does.
        return self.decode(keys, dtype, stored), self.decode(values, dtype, stored)

    def _decode_window(
        self,
        ring_k: torch.Tensor,
        ring_v: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: WindowPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """update_window's decode step: k/v (stored form) into the ring, the ring back."""
        window, batch = self.window, k.shape[0]
        if self.rows is None and batch == 1:
            if ring_k.shape[0] != 1:
                ring_k, ring_v = ring_k[:1], ring_v[:1]
            slot = plan.starts[0] % window
            ring_k.narrow(2, slot, 1).copy_(k)
            ring_v.narrow(2, slot, 1).copy_(v)
            if plan.keys == window:  # the whole ring: no view to make
                return ring_k, ring_v
            return ring_k.narrow(2, 0, plan.keys), ring_v.narrow(2, 0, plan.keys)
        rows = self.rows if self.rows is not None else torch.arange(batch, device=k.device)
        slots = torch.tensor(plan.starts, device=k.device) % window
        ring_k[rows, :, slots] = k[:, :, 0]
        ring_v[rows, :, slots] = v[:, :, 0]
        return ring_k[rows], ring_v[rows]

    def save_windows(self) -> tuple | None:
        """A copy of this view's rings and their write marks, and of its recurrent state
        (None without either), for restore_windows: a benchmark that repeats a test from
        the same depth."""
        states = self.recurrent.save() if self.recurrent is not None else None
        if self.ring_k is None:
            return None if states is None else (None, states)
        rows = self.rows if self.rows is not None else slice(None)
        marks = [self.written[r] for r in self.base_rows]
        rings = [(k[:, rows].clone(), v[:, rows].clone()) for k, v in self._rings()]
        return (rings, marks), states

    def restore_windows(self, saved: tuple | None) -> None:
        if saved is None:
            return
        rings, states = saved
        if states is not None:
            self.recurrent.restore(states)
        if rings is None:
            return
        copies, marks = rings
        rows = self.rows if self.rows is not None else slice(None)
        for (k, v), (saved_k, saved_v) in zip(self._rings(), copies, strict=True):
            k[:, rows] = saved_k
            v[:, rows] = saved_v
        for r, mark in zip(self.base_rows, marks, strict=True):
            self.written[r] = mark

    def save_span(self, start: int, count: int) -> tuple | None:
        """What writing positions start .. start + count - 1 of this one-row view will
        overwrite in its rings (count <= window), and the row's write mark, for
        restore_span: tokens that may be taken back (speculative decoding's drafts).
        None without rings, or with nothing to write."""
        if self.ring_k is None or count <= 0:
            return None
        if count > self.window or self.rows is not None or len(self.base_rows) != 1:
            raise ValueError("save_span: one row of at most a window's positions")
        slots = torch.tensor([(start + i) % self.window for i in range(count)])
        slots = slots.to(self.k.device)
        copies = [
            (k[:, :1, :, slots].clone(), v[:, :1, :, slots].clone()) for k, v in self._rings()
        ]
        return start, slots, copies, self.written[self.base_rows[0]]

    def restore_span(self, saved: tuple | None, end: int) -> None:
        """Take back the writes of save_span's positions from `end` on: their ring slots
        as they were before, and the write mark where the kept positions end, so a
        continuation from `end` finds every key it attends to."""
        if saved is None:
            return
        start, slots, copies, mark = saved
        first = max(end - start, 0)
        if first < len(slots):
            for (k, v), (saved_k, saved_v) in zip(self._rings(), copies, strict=True):
                k[:, :1, :, slots[first:]] = saved_k[:, :, :, first:]
                v[:, :1, :, slots[first:]] = saved_v[:, :, :, first:]
        self.written[self.base_rows[0]] = max(mark, min(end, start + len(slots)))

    def _rings(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ring buffers' keys and values (one pair per shape of windowed layer)."""
        return [self.buffers[g] for g in self.ring_buffers]
