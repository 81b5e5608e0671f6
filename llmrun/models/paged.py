"""Paged KV cache: one pool of fixed-size blocks per layer, read through block tables.

The pool holds, per layer, [blocks, Hkv, block_rows, D] keys and values (stored as
the cache type, like KVCache). A forward gets a view with one block table per row
(llmrun.kv_blocks says which blocks a sequence holds): position p of row b lives in
row p % block_rows of block tables[b][p // block_rows], so sequences share prefix
blocks and use memory for the tokens they hold, not for a whole context.

Attention reads through the tables on every path: a decode step (one token per
row) on CPU f32 runs the native kernel on each row's blocks in place
(ops.attend_paged, a sliding window as its first key); elsewhere (prefill, GPU, MPS,
bf16 activations, gpt-oss's sinks) the blocks a forward attends to are gathered into
[B, Hkv, L, D] for torch's attention, with the forward's mask. Sliding-window
layers (Gemma 2/3, gpt-oss) are held whole here and masked to their window; their
blocks that left the window are not freed.

On CPU the pool is an anonymous memory map: the kernel hands out its pages zeroed when
they are first written, so the process's memory grows with the blocks used, not with
the pool's size (torch.zeros would write all of it up front).
"""

from __future__ import annotations

import mmap

import torch

from llmrun import ops
from llmrun.models.cache import KVCache


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU in a map of their own, resident only where written."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class PagedKVCache:
    """The block pool of every layer; view(tables) is what a forward takes."""

    def __init__(self, like: KVCache, n_blocks: int, block_rows: int, max_seq_len: int) -> None:
        """A pool of `n_blocks` blocks of `block_rows` positions, storing keys and
        values as `like` (a one-position KVCache of the model: its layers, KV heads,
        row width and cache type) does; a sequence holds at most max_seq_len positions."""
        n_layers, _, kv_heads, _, width = like.k.shape
        shape = (n_layers, n_blocks, kv_heads, block_rows, width)
        self.k = zeros(shape, like.storage, like.k.device)
        self.v = zeros(shape, like.storage, like.k.device)
        self.like = like  # its encode()/decode() convert to and from the cache type
        self.n_blocks, self.block_rows, self.max_seq_len = n_blocks, block_rows, max_seq_len

    @staticmethod
    def block_bytes(like: KVCache, block_rows: int) -> int:
        """Bytes one block takes, keys and values of every layer."""
        n_layers, _, kv_heads, _, width = like.k.shape
        return 2 * n_layers * kv_heads * block_rows * width * like.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def view(self, tables: list[list[int]], counts: list[int] | None = None) -> PagedView:
        """A forward's cache: row b reads and writes the blocks tables[b]. `counts`:
        each row's real tokens where rows are padded on the right (the padding is
        never stored)."""
        return PagedView(self, tables, counts)


class PagedView:
    """One forward's rows of a PagedKVCache (the model calls it as a KVCache)."""

    paged = True
    window = None  # no rings: windowed layers are masked (see the module docstring)

    def __init__(self, pool: PagedKVCache, tables: list[list[int]], counts: list[int] | None):
        self.pool, self.counts = pool, counts
        self.k, self.max_seq_len = pool.k, pool.max_seq_len
        width = max(len(t) for t in tables)
        # Short tables padded with block 0: read only where the mask hides it.
        rows = [t + [0] * (width - len(t)) for t in tables]
        self.tables = torch.tensor(rows, dtype=torch.int32)  # for the native kernel, on CPU
        self.index = self.tables.to(pool.k.device, torch.long)
        self._where: tuple | None = None  # the first layer's write indices, for every layer
        self._firsts: tuple | None = None

    def reusable(self, n: int) -> int:
        return n

    def windowed(self, layer: int) -> bool:
        return False

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k/v [B, Hkv, T, D] at positions [B, T] through the tables."""
        if self._where is None:
            rows = self.pool.block_rows
            blocks = torch.gather(self.index, 1, positions // rows)
            offsets = positions % rows
            keep = None
            if self.counts is not None:
                counts = torch.tensor(self.counts, device=positions.device)
                keep = torch.arange(positions.shape[1], device=positions.device) < counts[:, None]
                blocks, offsets = blocks[keep], offsets[keep]
            self._where = blocks, offsets, keep
        blocks, offsets, keep = self._where
        # [B, Hkv, T, D] -> [B, T, Hkv, D], the shape pool[blocks, :, offsets] takes
        k, v = self.pool.like.encode(k).transpose(1, 2), self.pool.like.encode(v).transpose(1, 2)
        if keep is not None:
            k, v = k[keep], v[keep]
        self.k[layer][blocks, :, offsets] = k
        self.pool.v[layer][blocks, :, offsets] = v

    def read(
        self, layer: int, length: int, dtype: torch.dtype, stored: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values of positions 0 .. length - 1, gathered into
        [B, Hkv, length, D] in `dtype` (as stored with `stored`)."""
        rows = self.pool.block_rows
        table = self.index[:, : -(-length // rows)]
        out = []
        for pool in (self.k[layer], self.pool.v[layer]):
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
        window); [B, 1, H*D], or None where the native kernel cannot run it."""
        if q.shape[2] != 1:
            return None
        ends = (positions[:, 0] + 1).tolist()
        if mask is None:
            firsts = [0] * len(ends)
        else:
            if self._firsts is None or self._firsts[0] is not mask:
                # The first key each row attends to: the mask is a range per row.
                self._firsts = mask, mask[:, 0, 0].int().argmax(-1).tolist()
            firsts = self._firsts[1]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        k, v = self.k[layer], self.pool.v[layer]
        rows = []
        for b, (first, end) in enumerate(zip(firsts, ends, strict=True)):
            y = ops.attend_paged(q[b : b + 1], k, v, self.tables[b], first, end, scale, softcap)
            if y is None:
                return None
            rows.append(y)
        return rows[0] if len(rows) == 1 else torch.cat(rows)
