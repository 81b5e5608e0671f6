"""Paged KV cache: one pool of fixed-size blocks per layer, read through block tables.

The pool holds, per layer, [blocks, Hkv, block_rows, D] keys and values (stored as
the cache type, like KVCache), each layer in its own shape (Gemma 4's differ): layers of
one shape share a tensor. A forward gets a view with one block table per row
(llmrun.kv_blocks says which blocks a sequence holds): position p of row b lives in
row p % block_rows of block tables[b][p // block_rows], so sequences share prefix
blocks and use memory for the tokens they hold, not for a whole context.

Attention reads through the tables on every path: a decode step (one token per
row) on CPU f32 runs the native kernel on each row's blocks in place
(ops.attend_paged, a sliding window as its first key); elsewhere (prefill, GPU, MPS,
bf16 activations, gpt-oss's sinks) the blocks a forward attends to are gathered into
[B, Hkv, L, D] for torch's attention, with the forward's mask.

Sliding-window layers (Gemma 2/3, gpt-oss) are masked to their window on every
path. Given `window_blocks`, they keep their keys in a pool of their own, read
through tables of their own, in which the block manager (llmrun.kv_blocks.KVBlocks)
lets go of the blocks that left the window: a let-go entry reads block 0, where
only keys outside the window, which the mask hides, are looked for.

On CPU the pool is an anonymous memory map: the kernel hands out its pages zeroed when
they are first written, so the process's memory grows with the blocks used, not with
the pool's size (torch.zeros would write all of it up front).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from llmrun import ops
from llmrun.models.cache import KVCache
from llmrun.models.recurrent import RecurrentState


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU in a map of their own, resident only where written."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def window_layers(like: KVCache, max_seq_len: int) -> tuple[list[bool], int | None]:
    """Which layers of a model (given by `like`, its one-position KVCache) can keep
    their keys in a windowed pool of their own, and their window: those whose sliding
    window is shorter than max_seq_len, where the model has full layers too (else
    none: one group, the windowed layers masked)."""
    windowed = [w is not None and w < max_seq_len for w in like.windows]
    if not any(windowed) or all(windowed):
        return [False] * len(windowed), None
    return windowed, next(w for w, wd in zip(like.windows, windowed, strict=True) if wd)


class PagedKVCache:
    """The block pools of every layer; view(tables) is what a forward takes."""

    def __init__(
        self,
        like: KVCache,
        n_blocks: int,
        block_rows: int,
        max_seq_len: int,
        window_blocks: int = 0,
    ) -> None:
        """A pool of `n_blocks` blocks of `block_rows` positions, storing keys and
        values as `like` (a one-position KVCache of the model: its layers, KV heads,
        row width and cache type) does; a sequence holds at most max_seq_len positions.
        `window_blocks` > 0: the sliding-window layers (window_layers) get a pool of
        their own of that many blocks, read through tables of their own."""
        windowed = (
            window_layers(like, max_seq_len)[0] if window_blocks else [False] * len(like.windows)
        )
        self.group = [int(w) for w in windowed]  # each layer's tables: 0 full, 1 windowed
        # A pool per table group and layer shape (KVCache.layer_shape), the first a full
        # one (of no layers in a model without any).
        shapes = [like.layer_shape(i) for i in range(len(windowed))]
        full = [s for g, s in zip(self.group, shapes, strict=True) if g == 0]
        kinds = [(0, full[0] if full else (like.k.shape[2], like.k.shape[4]))]
        kinds += [k for k in dict.fromkeys(zip(self.group, shapes, strict=True)) if k != kinds[0]]
        self.where: list[tuple[int, int]] = []  # each layer's pool and its index there
        counts = [0] * len(kinds)
        for kind in zip(self.group, shapes, strict=True):
            pool = kinds.index(kind)
            self.where.append((pool, counts[pool]))
            counts[pool] += 1
        device = like.k.device
        # Values that are the keys (KVCache's values_are_keys) share their pool.
        shared = like.values_are_keys
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (group, (kv_heads, width)), layers in zip(kinds, counts, strict=True):
            blocks = window_blocks if group else n_blocks
            shape = (layers, blocks, kv_heads, block_rows, width)
            k = zeros(shape, like.storage, device)
            self.pools.append((k, k if shared else zeros(shape, like.storage, device)))
        self.uniform = like.uniform
        # Each table group's first pool: what a uniform model's native decode step reads.
        self.k, self.v = self.pools[0]
        self.window_k = self.window_v = None
        if any(windowed):
            self.window_k, self.window_v = self.pools[[g for g, _ in kinds].index(1)]
        self.like = like  # its encode()/decode() convert to and from the cache type
        self.n_blocks, self.block_rows, self.max_seq_len = n_blocks, block_rows, max_seq_len

    @staticmethod
    def block_bytes(like: KVCache, block_rows: int, layers: Sequence[int] | None = None) -> int:
        """Bytes one block takes, keys and values of every layer (or of `layers`)."""
        return block_rows * like.position_bytes(layers)

    @property
    def nbytes(self) -> int:
        copies = 1 if self.v is self.k else 2
        return copies * sum(k.nbytes for k, _ in self.pools)

    def save_span(self, start: int, count: int) -> None:
        """KVCache.save_span's counterpart, with nothing to save: there are no rings, and a
        sequence's positions past its tokens are written before they are read again."""
        return None

    def restore_span(self, saved: None, end: int) -> None:
        """Nothing to put back (see save_span)."""

    def view(
        self,
        tables: list[list[int]],
        counts: list[int] | None = None,
        window_tables: list[list[int]] | None = None,
    ) -> PagedView:
        """A forward's cache: row b reads and writes the blocks tables[b] (in the
        windowed layers' pool, window_tables[b]: a negative entry is a block let go
        of, which only a key outside the window would read). `counts`: each row's
        real tokens where rows are padded on the right (the padding is never
        stored)."""
        return PagedView(self, tables, counts, window_tables)


class _Group:
    """One table group of a forward's view: the rows' tables into its pools, and its first
    pool's keys and values (a uniform model's only one, which the native decode step reads)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, tables: list[list[int]]) -> None:
        width = max(len(t) for t in tables)
        # Short tables padded with block 0, let-go blocks read as block 0: only where
        # the mask hides them.
        rows = [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables]
        self.k, self.v = k, v
        self.tables = torch.tensor(rows, dtype=torch.int32)  # for the native kernel, on CPU
        self.index = self.tables.to(k.device, torch.long)
        self.where: tuple | None = None  # the first layer's write indices, for every layer


class PagedView:
    """One forward's rows of a PagedKVCache (the model calls it as a KVCache)."""

    paged = True
    window = None  # no rings: windowed layers are masked (see the module docstring)
    # A hybrid model's recurrent state: the scheduler's rows of this view's sequences.
    recurrent: RecurrentState | None = None
    # Each row's shift of its text tokens' M-RoPE positions [B] (Qwen2-VL's after
    # images, llmrun.models.mrope); None: none is shifted.
    rope_shifts: torch.Tensor | None = None
    # Each row's prompt length [B] for reference sliding-window attention (Unlimited-OCR,
    # llmrun.models.deepseek); None: full attention.
    prompt_ends: torch.Tensor | None = None

    def __init__(
        self,
        pool: PagedKVCache,
        tables: list[list[int]],
        counts: list[int] | None,
        window_tables: list[list[int]] | None = None,
    ):
        self.pool, self.counts, self.uniform = pool, counts, pool.uniform
        self.k, self.max_seq_len = pool.k, pool.max_seq_len
        self.groups = [_Group(pool.k, pool.v, tables)]
        if pool.window_k is not None:
            if window_tables is None or len(window_tables) != len(tables):
                raise ValueError("a pool with a windowed group needs a window table per row")
            self.groups.append(_Group(pool.window_k, pool.window_v, window_tables))
        self.tables = self.groups[0].tables
        self._firsts: tuple | None = None

    def reusable(self, n: int) -> int:
        return n

    def windowed(self, layer: int) -> bool:
        return False

    def layer_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The layer's keys and values [blocks, Hkv, block_rows, width], and its group."""
        pool, index = self.pool.where[layer]
        k, v = self.pool.pools[pool]
        return k[index], v[index], self.pool.group[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k/v [B, Hkv, T, D] at positions [B, T] through the tables."""
        group = self.groups[self.pool.group[layer]]
        if group.where is None:
            rows = self.pool.block_rows
            blocks = torch.gather(group.index, 1, positions // rows)
            offsets = positions % rows
            keep = None
            if self.counts is not None:
                counts = torch.tensor(self.counts, device=positions.device)
                keep = torch.arange(positions.shape[1], device=positions.device) < counts[:, None]
                blocks, offsets = blocks[keep], offsets[keep]
            group.where = blocks, offsets, keep
        blocks, offsets, keep = group.where
        # [B, Hkv, T, D] -> [B, T, Hkv, D], the shape pool[blocks, :, offsets] takes
        k, v = self.pool.like.encode(k).transpose(1, 2), self.pool.like.encode(v).transpose(1, 2)
        if keep is not None:
            k, v = k[keep], v[keep]
        k_pool, v_pool, _ = self.layer_pool(layer)
        k_pool[blocks, :, offsets] = k
        v_pool[blocks, :, offsets] = v

    def read(
        self, layer: int, length: int, dtype: torch.dtype, stored: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values of positions 0 .. length - 1, gathered into
        [B, Hkv, length, D] in `dtype` (as stored with `stored`)."""
        rows = self.pool.block_rows
        k_pool, v_pool, group = self.layer_pool(layer)
        table = self.groups[group].index[:, : -(-length // rows)]
        out = []
        for pool in (k_pool, v_pool):
            blocks = pool[table]  # [B, n, Hkv, rows, D]
            batch, n, heads, _, width = blocks.shape
            x = blocks.transpose(1, 2).reshape(batch, heads, n * rows, width)[:, :, :length]
            out.append(self.pool.like.decode(x, dtype, stored))
        return out[0], out[1]

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
        """KVCache.update through the tables: store, then gather what is attended to."""
        dtype = k.dtype
        self.write(layer, k, v, positions)
        return self.read(layer, length, dtype, stored)

    def attend_one(
        self,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float | None,
        softcap: float | None,
    ) -> torch.Tensor | None:
        """A decode step's attention q [B, H, 1, D] read from the blocks in place, each
        row over the keys its mask row allows (a causal range, cut by a sliding
        window); [B, 1, H*D], or None where the native kernel cannot run it (or the
        mask is no range: a reference window's prompt and window)."""
        if q.shape[2] != 1:
            return None
        ends = (positions[:, 0] + 1).tolist()
        if mask is None:
            firsts = [0] * len(ends)
        else:
            if self._firsts is None or self._firsts[0] is not mask:
                # The first key each row attends to, where the mask is a range per row.
                row = mask[:, 0, 0]
                first = row.int().argmax(-1)
                ranged = bool((row.sum(-1) == positions[:, 0] + 1 - first).all())
                self._firsts = mask, first.tolist() if ranged else None
            firsts = self._firsts[1]
            if firsts is None:
                return None
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        k, v, group = self.layer_pool(layer)
        tables = self.groups[group].tables
        rows = []
        for b, (first, end) in enumerate(zip(firsts, ends, strict=True)):
            y = ops.attend_paged(q[b : b + 1], k, v, tables[b], first, end, scale, softcap)
            if y is None:
                return None
            rows.append(y)
        return rows[0] if len(rows) == 1 else torch.cat(rows)
