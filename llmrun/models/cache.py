"""Preallocated KV cache: one static buffer per layer, written at token positions.

Static shapes keep allocation off the per-token path and let torch.compile and
CUDA graphs apply. Each batch row is an independent sequence (a serving slot);
a row's entries past its current position are stale and masked out, so
keeping a shared prefix is just a matter of writing from where it ends.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.rows: torch.Tensor | None = None  # slots of a non-contiguous select()

    def select(self, slots: Sequence[int]) -> KVCache:
        """A view of the rows `slots`, in order: a forward with len(slots) rows
        reads and writes those slots, and no others, of this cache."""
        view = copy.copy(self)
        first, count = slots[0], len(slots)
        if list(slots) == list(range(first, first + count)):
            view.k, view.v = self.k[:, first : first + count], self.v[:, first : first + count]
        else:
            view.rows = torch.tensor(list(slots), device=self.k.device)
        return view

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        first: int,
        length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, Hkv, T, D] at positions [B, T] (whose first is `first` and
        maximum `length` - 1); return the keys and values of positions
        0 .. length - 1 for every row."""
        batch, tokens = positions.shape
        if self.rows is not None:
            # Scattered slots: index writes, and a gathered copy of their prefixes to attend to.
            k_layer, v_layer = self.k[layer], self.v[layer]
            k_layer[self.rows[:, None], :, positions] = k.transpose(1, 2)
            v_layer[self.rows[:, None], :, positions] = v.transpose(1, 2)
            return k_layer[self.rows, :, :length], v_layer[self.rows, :, :length]
        k_cache, v_cache = self.k[layer], self.v[layer]
        if batch != k_cache.shape[0]:
            k_cache, v_cache = k_cache[:batch], v_cache[:batch]
        if batch == 1 and length - first == tokens:
            # One sequence, contiguous positions: a plain slice write (narrow: one op
            # where indexing takes several, and decode does this per layer per token).
            k_cache.narrow(2, first, tokens).copy_(k)
            v_cache.narrow(2, first, tokens).copy_(v)
            return k_cache.narrow(2, 0, length), v_cache.narrow(2, 0, length)
        rows = torch.arange(batch, device=positions.device)[:, None]
        k_cache[rows, :, positions] = k.transpose(1, 2)
        v_cache[rows, :, positions] = v.transpose(1, 2)
        return k_cache[:, :, :length], v_cache[:, :, :length]
