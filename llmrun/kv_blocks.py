"""The block manager of serve's paged KV cache: which pool blocks each sequence holds.

The pool (llmrun.models.paged.PagedKVCache) is `n_blocks` blocks of BLOCK_SIZE
positions; a sequence's block table lists the blocks holding its positions
0..15, 16..31, ... in order. Pure bookkeeping, no tensors: the scheduler thread
alone calls it.

Automatic prefix caching: a block whose 16 positions are all computed is named by
the SHA-256 chain of every token up to and including it (the hash of the previous
block's name and its own tokens), so two sequences that share a prefix share its
blocks, each counted by reference. The chain starts from a sequence's `root`: what
else its keys and values depend on (serve's per-request LoRA scales), so sequences
that differ there share no block. A block's salt joins its name too: the digest of
each image whose tokens begin in it (every image's placeholder tokens are the same
ids), so from there on prompts share blocks only where they hold the same image. A
block nobody holds keeps its keys and values and its name until its space is needed:
free blocks are reused nameless ones first, then named ones least recently released
first. A sequence releases its blocks last to first, so a conversation's tail is
evicted before the prefix it shares with others.

Sliding-window layers (Gemma 2/3, gpt-oss) attend only to their last `window`
positions, so their keys and values have a pool of their own, with a block manager
of its own (KVBlocks): a sequence's table there lets go of each block once it has
left the window of every later position (a HOLE where it was), so a 32k-token
sequence holds its window's blocks, not 2,000 of them, in those layers. A prefix
is reused only as far as the windowed layers still hold what its continuation
attends to; the rest is prefilled again, never read from blocks that were reused
for something else. A hybrid model's prefix is reused only up to a block at whose end
its recurrent state was kept (`ends`: llmrun.models.recurrent.StateSnapshots).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

# Positions per block. 16: a prefix hit reuses whole blocks, so smaller blocks reuse
# more of a prompt and waste at most 15 positions per sequence; 16 rows of a KV head
# (4 KiB at head_dim 64 in f32) are still a long contiguous read for the decode
# kernel, and the tables stay short (256 entries for a 4096-token context).
BLOCK_SIZE = 16
# A windowed table's entry for a block it has let go of.
HOLE = -1


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks, in position order (HOLE where a windowed table let go of
    one), and the names of its leading full blocks (those registered in the prefix
    cache or found there)."""

    blocks: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    holes: int = 0  # the leading entries that are HOLEs
    root: bytes = b""  # where its names' chain starts (see the module docstring)
    salts: Mapping[int, bytes] = field(default_factory=dict)  # by block index (see there)


class BlockManager:
    """`n_blocks` blocks of `block_size` positions, with or without prefix caching."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE, prefix_cache: bool = True):
        if n_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {n_blocks}")
        self.n_blocks, self.block_size, self.prefix_cache = n_blocks, block_size, prefix_cache
        self.refs = [0] * n_blocks
        self.name_of: list[bytes | None] = [None] * n_blocks
        self.by_name: dict[bytes, int] = {}
        self.empty: list[int] = list(range(n_blocks - 1, -1, -1))  # nameless and free; pop()
        self.cached: OrderedDict[int, None] = OrderedDict()  # named and free, oldest first

    @property
    def free(self) -> int:
        """Blocks that can be allocated now (evicting cached ones as needed)."""
        return len(self.empty) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.n_blocks - self.free

    @property
    def cached_blocks(self) -> int:
        """Blocks that keep a named prefix (held or not)."""
        return len(self.by_name)

    def names(
        self,
        tokens: Sequence[int],
        start: bytes = b"",
        salts: Mapping[int, bytes] | None = None,
        first: int = 0,
    ) -> list[bytes]:
        """The names of the full blocks of `tokens`, which begin at block index `first`
        (after the block named `start`), each salted by salts[its index]."""
        size, out, name = self.block_size, [], start
        for index, begin in enumerate(range(0, len(tokens) - size + 1, size), first):
            chunk = b"".join(t.to_bytes(4, "little") for t in tokens[begin : begin + size])
            salt = salts.get(index, b"") if salts else b""
            name = hashlib.sha256(name + chunk + salt).digest()
            out.append(name)
        return out

    def lookup(
        self, tokens: Sequence[int], root: bytes = b"", salts: Mapping[int, bytes] | None = None
    ) -> list[int]:
        """The cached blocks holding the longest run of `tokens`' full leading blocks."""
        if not self.prefix_cache:
            return []
        hits = []
        for name in self.names(tokens, root, salts):
            block = self.by_name.get(name)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self,
        tokens: Sequence[int],
        positions: int,
        most: int | None = None,
        root: bytes = b"",
        salts: Mapping[int, bytes] | None = None,
    ) -> tuple[BlockTable, int] | None:
        """A table (of names chained from `root`, salted by `salts`) for a sequence whose
        first `positions` positions will hold `tokens`' (the tokens to prefill), reusing
        cached leading blocks of tokens[:-1] (a sequence always feeds at least one token,
        for its logits), at most `most` of them; with how many positions it reuses.
        None, allocating nothing, when the free blocks do not suffice."""
        hits = self.lookup(tokens[:-1], root, salts)[:most]
        fresh = blocks_for(positions, self.block_size) - len(hits)
        # Cached blocks nobody holds are free ones too: taking them leaves fewer.
        idle_hits = sum(1 for b in hits if self.refs[b] == 0)
        if fresh > self.free - idle_hits:
            return None
        table = BlockTable(root=root, salts=salts or {})
        for block in hits:
            self._hold(block)
            table.blocks.append(block)
        table.names = [self.name_of[b] for b in hits]
        for _ in range(max(fresh, 0)):
            table.blocks.append(self._take())
        return table, len(hits) * self.block_size

    def grow(self, table: BlockTable, positions: int) -> bool:
        """Extend `table` to hold `positions` positions; False (and no change) when
        there are not enough free blocks."""
        more = blocks_for(positions, self.block_size) - len(table.blocks)
        if more > self.free:
            return False
        for _ in range(more):
            table.blocks.append(self._take())
        return True

    def commit(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """Name the full blocks of a sequence whose cached positions hold `tokens`, so
        later sequences can find them. A block whose name another block already has
        (the same prefix computed twice at once) stays nameless."""
        if not self.prefix_cache:
            return
        done = len(table.names)
        full = len(tokens) // self.block_size
        if full <= done:
            return
        size = self.block_size
        start = table.names[-1] if table.names else table.root
        named = self.names(tokens[done * size : full * size], start, table.salts, done)
        for i, name in enumerate(named, done):
            table.names.append(name)
            block = table.blocks[i]
            if block != HOLE and name not in self.by_name and self.name_of[block] is None:
                self.by_name[name] = block
                self.name_of[block] = name

    def release(self, table: BlockTable) -> None:
        """Let go of a sequence's blocks, last to first (see the module docstring)."""
        for block in reversed(table.blocks):
            self._let_go(block)
        table.blocks.clear()
        table.names.clear()
        table.holes = 0

    def drop(self, table: BlockTable, before: int) -> None:
        """Let go of the table's blocks before index `before` (a windowed table's blocks
        that left the window), oldest first, so they are the first to be evicted."""
        before = min(before, len(table.blocks))
        for i in range(table.holes, before):
            self._let_go(table.blocks[i])
            table.blocks[i] = HOLE
        table.holes = max(table.holes, before)

    def attach(self, table: BlockTable, names: Sequence[bytes], first: int) -> None:
        """Make `table` (empty) hold the cached blocks named names[first:] at their
        indices, holes before them, and carry all of `names` (see KVBlocks.allocate)."""
        table.blocks, table.holes = [HOLE] * first, first
        for name in names[first:]:
            block = self.by_name[name]
            self._hold(block)
            table.blocks.append(block)
        table.names = list(names)

    def _let_go(self, block: int) -> None:
        if block == HOLE:
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.name_of[block] is None:
                self.empty.append(block)
            else:
                self.cached[block] = None

    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def _take(self) -> int:
        """A free block for new keys: a nameless one, else the least recently released
        cached one, which loses its name."""
        if self.empty:
            block = self.empty.pop()
        else:
            block, _ = self.cached.popitem(last=False)
            del self.by_name[self.name_of[block]]
            self.name_of[block] = None
        self.refs[block] = 1
        return block


@dataclass(eq=False)
class SequenceBlocks:
    """A sequence's tables: the full layers', and the sliding-window layers' (None
    where the pool has no windowed group)."""

    full: BlockTable
    window: BlockTable | None = None


class KVBlocks:
    """The block managers of a pool's layer groups: `full` for the layers that keep
    every position, and `window_manager` (with `window_blocks` > 0) for the
    sliding-window layers, whose tables keep only the blocks that hold one of the
    last `window` positions. n_blocks, used, free and cached_blocks are the full
    group's, the one whose size bounds how many tokens the pool holds."""

    def __init__(
        self,
        n_blocks: int,
        block_size: int = BLOCK_SIZE,
        prefix_cache: bool = True,
        window: int | None = None,
        window_blocks: int = 0,
    ) -> None:
        self.full = BlockManager(n_blocks, block_size, prefix_cache)
        self.window_manager = (
            BlockManager(window_blocks, block_size, prefix_cache) if window_blocks else None
        )
        self.window = window

    @property
    def n_blocks(self) -> int:
        return self.full.n_blocks

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def free(self) -> int:
        return self.full.free

    @property
    def used(self) -> int:
        return self.full.used

    @property
    def cached_blocks(self) -> int:
        return self.full.cached_blocks

    def allocate(
        self,
        tokens: Sequence[int],
        positions: int,
        reuse: bool = True,
        ends: Container[bytes] | None = None,
        root: bytes = b"",
        salts: Mapping[int, bytes] | None = None,
    ) -> tuple[SequenceBlocks, int] | None:
        """BlockManager.allocate for every group: the full layers' blocks for all
        `positions`, the windowed layers' cached blocks of the reused prefix that its
        continuation attends to (their new blocks come with grow). The prefix reused
        is the longest the full layers hold whose window the windowed layers hold, and
        that ends at a block named in `ends` where that is given (a hybrid model's
        kept recurrent states); none without `reuse`. Names chain from `root`, salted by
        `salts`."""
        most = None if reuse else 0
        if reuse and (self.window_manager is not None or ends is not None):
            hits = len(self.full.lookup(tokens[:-1], root, salts))
            names = self.full.names(tokens[: hits * self.block_size], root, salts)
            most = self._reusable(names, ends)
        got = self.full.allocate(tokens, positions, most, root, salts)
        if got is None:
            return None
        table, reused = got
        blocks = SequenceBlocks(table)
        if self.window_manager is not None:
            blocks.window = BlockTable(root=root, salts=table.salts)
            count = reused // self.block_size
            self.window_manager.attach(blocks.window, table.names[:count], self._first(reused))
        return blocks, reused

    def grow(self, blocks: SequenceBlocks, positions: int) -> bool:
        """BlockManager.grow for every group; False (and no change) if one cannot."""
        window = self.window_manager
        if window is not None:
            more = blocks_for(positions, self.block_size) - len(blocks.window.blocks)
            if more > window.free:
                return False
        if not self.full.grow(blocks.full, positions):
            return False
        if window is not None:
            window.grow(blocks.window, positions)
        return True

    def commit(self, blocks: SequenceBlocks, tokens: Sequence[int]) -> None:
        """BlockManager.commit for every group; the windowed table then lets go of the
        blocks that no position from len(tokens) on attends to."""
        self.full.commit(blocks.full, tokens)
        if self.window_manager is not None:
            self.window_manager.commit(blocks.window, tokens)
            self.window_manager.drop(blocks.window, self._first(len(tokens)))

    def release(self, blocks: SequenceBlocks) -> None:
        self.full.release(blocks.full)
        if self.window_manager is not None:
            self.window_manager.release(blocks.window)

    def _first(self, position: int) -> int:
        """The first block a query at `position` attends to in the windowed layers."""
        return max(position - self.window + 1, 0) // self.block_size

    def _reusable(self, names: list[bytes], ends: Container[bytes] | None) -> int:
        """How many of the leading full blocks named `names` (cached in the full group)
        a prompt may reuse: the most whose continuation finds every windowed block it
        attends to cached too, and that end at a block named in `ends` (if given)."""
        windowed = self.window_manager
        held = [windowed is not None and name in windowed.by_name for name in names]
        count = len(names)
        while count and (
            (windowed is not None and not all(held[self._first(count * self.block_size) : count]))
            or (ends is not None and names[count - 1] not in ends)
        ):
            count -= 1
        return count
