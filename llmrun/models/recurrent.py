"""Recurrent layers' state: what a sequence's linear-attention and convolution layers
carry from one token to the next.

Hybrid models keep, beside the KV cache of their attention layers, a state of fixed
size per sequence in each of their other layers: a short convolution's last inputs,
a linear attention's matrix (Qwen3.5's and Qwen3-Next's Gated DeltaNet, LFM2's
convolutions, Mamba-2). Unlike keys and values, a state sums up every token so far and
cannot be rolled back. So a sequence goes on only from exactly the position its state
has taken in, or from a copy kept on the way (`checkpoint()`: a prompt keeps one a few
tokens before its end, generate.CHECKPOINT_MARGIN); anything else (a shorter shared
prefix, an edited history) starts again from position 0, from zeros. `reusable()` says
so to generate.reuse_prefix (through KVCache.reusable), as KVCache.reusable does for
sliding-window rings. The server's prefix cache keeps states at block ends instead
(`StateSnapshots`, llmrun.batching).

The state lives in a KVCache (`cache.recurrent`) or in a paged view of the server's
pool (the scheduler keeps one row per running sequence). Each batch row is a sequence.
A forward first calls `begin()` once: a row that starts at position 0 is zeroed, one
that starts elsewhere must start where its state ends (else RuntimeError). Each
recurrent layer then reads its rows' state (`read`) and writes back the state after
the row's real tokens (`write`). Rows padded on the right repeat their last position
(as the server pads its batched prefills), so a row's real tokens are those up to
where its positions stop rising; the layers must leave the padding out of the state.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

# A layer's state: one tensor per part (a convolution's inputs, a recurrent matrix), each
# [rows, *shape].
LayerState = list[torch.Tensor]


class RecurrentState:
    """Per row (sequence) and recurrent layer, tensors of the given shapes, zeros at first."""

    def __init__(
        self,
        shapes: Mapping[int, Sequence[tuple[int, ...]]],
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """`shapes`: for each recurrent layer (by the model's layer index), the shape of
        each part of one row's state. States are kept in `dtype` (float32 for the
        recurrences, whatever the compute dtype: llama.cpp keeps them so too)."""
        self.shapes = {layer: [tuple(s) for s in parts] for layer, parts in shapes.items()}
        self.dtype = dtype
        self.tensors = {
            layer: [torch.zeros((batch, *s), dtype=dtype, device=device) for s in parts]
            for layer, parts in self.shapes.items()
        }
        # Per allocation row, shared by every view: how many tokens its state has taken in,
        # and a copy of its state at an earlier position (checkpoint()), if kept.
        self.seen = [0] * batch
        self.saved: dict[int, tuple[int, dict[int, LayerState]]] = {}
        self.rows = list(range(batch))  # this view's rows of the allocation
        self.index: torch.Tensor | None = None  # the rows, where they are not 0 .. n - 1

    def empty_like(self, batch: int) -> RecurrentState:
        """A new state of `batch` rows for the same layers."""
        device = next(iter(self.tensors.values()))[0].device if self.tensors else "cpu"
        return RecurrentState(self.shapes, batch, self.dtype, device)

    def select(self, rows: Sequence[int]) -> RecurrentState:
        """A view of the allocation rows `rows`, in order: a forward with len(rows) rows
        reads and writes those, and no others."""
        view = copy.copy(self)
        view.rows = [self.rows[r] for r in rows]
        first = view.rows[0] if view.rows else 0
        contiguous = view.rows == list(range(first, first + len(view.rows)))
        view.index = None
        if not contiguous or first != 0:
            device = next(iter(self.tensors.values()))[0].device if self.tensors else "cpu"
            view.index = torch.tensor(view.rows, device=device)
        return view

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for parts in self.tensors.values() for t in parts)

    @staticmethod
    def bytes_per_row(shapes: Mapping[int, Sequence[tuple[int, ...]]], dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes."""
        return sum(torch.Size(s).numel() * dtype.itemsize for p in shapes.values() for s in p)

    def reusable(self, n: int) -> int:
        """How many of the first n positions a continuation can keep: n where every row's
        state has taken in exactly n tokens, else where each row has a checkpoint at the
        same position up to n, else 0 (start again from position 0)."""
        if all(self.seen[r] == n for r in self.rows):
            return n
        marks = {self.saved[r][0] if r in self.saved else 0 for r in self.rows}
        mark = marks.pop()
        return mark if not marks and mark <= n else 0

    def checkpoint(self) -> None:
        """Keep a copy of each row's state where it is now, for a continuation from this
        position after the state has gone further (one per row: the latest)."""
        for r in self.rows:
            states = {layer: [t[r].clone() for t in parts] for layer, parts in self.tensors.items()}
            self.saved[r] = self.seen[r], states

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        """Start a forward of positions [B, T]: zero the rows that start at 0, refuse
        (RuntimeError) a row that does not start where its state ends, and record where
        each row's state will end. Returns each row's count of real tokens [B] (a row
        padded on the right repeats its last position)."""
        starts = positions[:, 0]
        counts = positions.max(dim=1).values - starts + 1
        for row, start, count in zip(self.rows, starts.tolist(), counts.tolist(), strict=True):
            if start == 0:
                self._zero(row)
            elif self.seen[row] != start and self.saved.get(row, (0,))[0] == start:
                for layer, parts in self.saved[row][1].items():
                    for t, kept in zip(self.tensors[layer], parts, strict=True):
                        t[row].copy_(kept)
            elif self.seen[row] != start:
                raise RuntimeError(
                    f"recurrent state row {row} holds {self.seen[row]} tokens, but the "
                    f"forward starts at position {start}; prefill the sequence again from "
                    "position 0 (RecurrentState.reusable says when)"
                )
            self.seen[row] = start + count
        return counts

    def _zero(self, row: int) -> None:
        """Start the row again: zeros, and no checkpoint of the tokens it held before."""
        self.saved.pop(row, None)
        for parts in self.tensors.values():
            for t in parts:
                t[row].zero_()

    def read(self, layer: int) -> LayerState:
        """The layer's state of this view's rows, [rows, *shape] per part (a copy where
        the rows are scattered: write() stores it back)."""
        parts = self.tensors[layer]
        if self.index is not None:
            return [t[self.index] for t in parts]
        n = len(self.rows)
        return [t if t.shape[0] == n else t[:n] for t in parts]

    def write(self, layer: int, state: LayerState) -> None:
        """Store the layer's new state of this view's rows (as read() shapes it)."""
        for t, new in zip(self.tensors[layer], state, strict=True):
            if self.index is not None:
                t[self.index] = new.to(t.dtype)
            else:
                target = t[: len(self.rows)]
                if target.data_ptr() != new.data_ptr():
                    target.copy_(new)

    def save(self) -> tuple:
        """A copy of this view's state and marks, for restore(): a benchmark that repeats
        a test from the same depth."""
        states = {layer: [t.clone() for t in self.read(layer)] for layer in self.tensors}
        return states, [self.seen[r] for r in self.rows]

    def restore(self, saved: tuple) -> None:
        states, marks = saved
        for layer, parts in states.items():
            self.write(layer, parts)
        for r, mark in zip(self.rows, marks, strict=True):
            self.seen[r] = mark


def copy_row(source: RecurrentState, row: int, target: RecurrentState, to: int) -> None:
    """Copy allocation row `row` of `source` into row `to` of `target` (same layers)."""
    for layer, parts in source.tensors.items():
        for part, into in zip(parts, target.tensors[layer], strict=True):
            into[to].copy_(part[row])


class StateSnapshots:
    """Recurrent states kept for the server's prefix cache: a sequence's state after its
    first k blocks of tokens, under the name of its k-th block (llmrun.kv_blocks names a
    block by the hash of every token up to its end). A later prompt that starts with
    those tokens takes the state and the blocks' keys and values, and prefills the rest.
    At most `capacity` are kept; the least recently used goes first."""

    def __init__(self, like: RecurrentState, capacity: int) -> None:
        self.states = like.empty_like(capacity)
        self.by_name: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))

    def __contains__(self, name: bytes) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def nbytes(self) -> int:
        return self.states.nbytes

    def put(self, name: bytes, source: RecurrentState, row: int) -> None:
        """Keep allocation row `row` of `source` under `name` (as used, if already kept)."""
        if name in self.by_name:
            self.by_name.move_to_end(name)
            return
        if self.free:
            to = self.free.pop()
        else:
            _, to = self.by_name.popitem(last=False)
        copy_row(source, row, self.states, to)
        self.by_name[name] = to

    def take(self, name: bytes, target: RecurrentState, row: int, tokens: int) -> None:
        """Put the state kept under `name`, that of the first `tokens` tokens, into
        allocation row `row` of `target`."""
        self.by_name.move_to_end(name)
        copy_row(self.states, self.by_name[name], target, row)
        target.seen[row] = tokens
