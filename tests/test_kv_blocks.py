"""The block manager: allocation, prefix hits and misses, sharing, eviction order,
and accounting that returns to all blocks free."""

import hashlib

import pytest

from llmrun.kv_blocks import HOLE, BlockManager, KVBlocks, blocks_for

B = 4  # positions per block, small so a few tokens fill several


def tokens(n, offset=0):
    return list(range(offset, offset + n))


def test_a_prompt_gets_the_blocks_of_its_positions():
    m = BlockManager(8, B)
    table, reused = m.allocate(tokens(9), 9)
    assert (len(table.blocks), reused, m.used, m.free) == (3, 0, 3, 5)
    assert len(set(table.blocks)) == 3
    m.release(table)
    assert (m.used, m.free, table.blocks) == (0, 8, [])


def test_names_chain_every_token_up_to_and_including_the_block():
    m = BlockManager(8, B)
    first = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in [0, 1, 2, 3])).digest()
    second = hashlib.sha256(first + b"".join(t.to_bytes(4, "little") for t in [4, 5, 6, 7]))
    assert m.names(tokens(10)) == [first, second.digest()]
    # The same second block after another first one is another block.
    assert m.names([9, 1, 2, 3, 4, 5, 6, 7])[1] != second.digest()


def test_a_salt_joins_its_blocks_name_and_every_later_one():
    """An image's digest salts the block its tokens begin in: the prompt with the same
    tokens and another image shares the blocks before it only; the same image, all."""
    m = BlockManager(8, B)
    red, blue = {1: b"red"}, {1: b"blue"}
    plain, salted = m.names(tokens(12)), m.names(tokens(12), salts=red)
    chunk = b"".join(t.to_bytes(4, "little") for t in [4, 5, 6, 7])
    assert salted[0] == plain[0]
    assert salted[1] == hashlib.sha256(plain[0] + chunk + b"red").digest()
    assert salted[2] != plain[2]
    table, _ = m.allocate(tokens(13), 13, salts=red)
    m.commit(table, tokens(13))
    assert table.names == salted
    m.release(table)
    other, reused = m.allocate(tokens(13), 13, salts=blue)
    same, reused_same = m.allocate(tokens(13), 13, salts=red)
    assert (reused, reused_same) == (B, 3 * B)
    m.release(other)
    m.release(same)
    assert m.used == 0


def test_a_later_prompt_reuses_the_full_blocks_of_a_finished_one():
    m = BlockManager(8, B)
    table, _ = m.allocate(tokens(10), 10)
    m.commit(table, tokens(10))  # two full blocks named, the partial third not
    old = list(table.blocks)
    m.release(table)
    assert (m.used, m.cached_blocks) == (0, 2)
    again, reused = m.allocate(tokens(12), 12)
    assert reused == 8 and again.blocks[:2] == old[:2]
    # A prompt that differs in its second block reuses only the first.
    m.release(again)
    other, reused = m.allocate(tokens(4) + tokens(8, offset=50), 12)
    assert reused == 4 and other.blocks[0] == old[0] and other.blocks[1] != old[1]


def test_the_last_token_is_always_fed_so_a_whole_cached_prompt_reuses_one_block_less():
    m = BlockManager(8, B)
    table, _ = m.allocate(tokens(8), 8)
    m.commit(table, tokens(8))
    m.release(table)
    _, reused = m.allocate(tokens(8), 8)
    assert reused == 4


def test_no_prefix_cache_names_nothing():
    m = BlockManager(8, B, prefix_cache=False)
    table, _ = m.allocate(tokens(8), 8)
    m.commit(table, tokens(8))
    m.release(table)
    assert m.cached_blocks == 0
    assert m.allocate(tokens(12), 12)[1] == 0


def test_concurrent_sequences_share_their_prefix_blocks_by_reference():
    m = BlockManager(8, B)
    a, _ = m.allocate(tokens(9), 9)
    m.commit(a, tokens(9))
    b, reused = m.allocate(tokens(8) + [99, 98], 10)
    assert reused == 8 and b.blocks[:2] == a.blocks[:2]
    assert m.used == 4  # 2 shared + a's third + b's third
    m.release(a)
    assert m.used == 3  # the shared blocks are still b's
    m.release(b)
    assert (m.used, m.free) == (0, 8)


def test_allocation_fails_whole_when_blocks_run_short():
    m = BlockManager(4, B)
    a, _ = m.allocate(tokens(12), 12)
    assert m.allocate(tokens(8, offset=100), 8) is None
    assert m.used == 3  # nothing taken by the failed one
    assert m.grow(a, 16) and m.used == 4
    assert not m.grow(a, 17) and len(a.blocks) == 4
    m.release(a)
    assert m.used == 0


def test_idle_cached_hits_count_against_the_free_blocks():
    m = BlockManager(3, B)
    a, _ = m.allocate(tokens(8), 8)
    m.commit(a, tokens(8))
    m.release(a)  # two cached, idle blocks; three free in all
    # 13 positions need 4 blocks: the 2 idle hits and 2 more, of the 1 left.
    assert m.allocate(tokens(13), 13) is None
    table, reused = m.allocate(tokens(12), 12)
    assert reused == 8 and m.used == 3


def test_eviction_takes_nameless_blocks_first_then_the_least_recently_released():
    m = BlockManager(6, B)
    old, _ = m.allocate(tokens(8), 8)
    m.commit(old, tokens(8))
    new, _ = m.allocate(tokens(8, offset=100), 8)
    m.commit(new, tokens(8, offset=100))
    m.release(old)
    m.release(new)
    # Two nameless blocks go first: every cached prefix survives.
    filler, _ = m.allocate(tokens(8, offset=200), 8)
    assert len(m.lookup(tokens(8))) == 2 and len(m.lookup(tokens(8, offset=100))) == 2
    # The next block evicts old's tail first (released last to first, old before new).
    m.grow(filler, 9)
    assert len(m.lookup(tokens(8))) == 1 and len(m.lookup(tokens(8, offset=100))) == 2
    m.grow(filler, 13)
    assert m.lookup(tokens(8)) == [] and len(m.lookup(tokens(8, offset=100))) == 2
    m.release(filler)
    assert m.used == 0


def test_a_reused_block_is_released_again_as_recent():
    m = BlockManager(4, B)
    a, _ = m.allocate(tokens(4), 4)
    m.commit(a, tokens(4))
    b, _ = m.allocate(tokens(4, offset=100), 4)
    m.commit(b, tokens(4, offset=100))
    m.release(a)
    m.release(b)
    # a's block is hit (and released) after b's: b's is now the older one.
    hit, reused = m.allocate(tokens(5), 5)
    assert reused == 4
    m.release(hit)
    filler, _ = m.allocate(tokens(12, offset=300), 12)  # the 2 nameless + 1 evicted
    assert len(m.lookup(tokens(4))) == 1 and m.lookup(tokens(4, offset=100)) == []
    m.release(filler)


def test_the_same_prefix_computed_twice_at_once_keeps_one_name():
    m = BlockManager(8, B)
    a, _ = m.allocate(tokens(5), 5)
    b, _ = m.allocate(tokens(5), 5)  # before a is committed: no hit
    m.commit(a, tokens(5))
    m.commit(b, tokens(5))
    assert m.cached_blocks == 1 and m.lookup(tokens(4)) == [a.blocks[0]]
    m.release(a)
    m.release(b)
    assert (m.used, m.cached_blocks) == (0, 1)


@pytest.mark.parametrize("n,expected", [(0, 0), (1, 1), (4, 1), (5, 2)])
def test_blocks_for(n, expected):
    assert blocks_for(n, B) == expected


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockManager(0, B)


# ---- a windowed group: sliding-window layers' blocks -----------------------------------

W = 6  # the window: a query at p attends to p - 5 .. p


def feed(kv, seq, history, new):
    """What the scheduler does for a forward of `new` tokens: grow, then commit."""
    assert kv.grow(seq, len(history) + len(new))
    history.extend(new)
    kv.commit(seq, history)


def test_a_windowed_table_lets_go_of_the_blocks_that_left_the_window():
    kv = KVBlocks(16, B, window=W, window_blocks=8)
    seq, reused = kv.allocate(tokens(10), 10)
    assert reused == 0 and len(seq.full.blocks) == 3 and seq.window.blocks == []
    history = []
    feed(kv, seq, history, tokens(10))
    # The next query (position 10) attends to 5 .. 10: blocks 1 and 2 of the window.
    assert seq.window.blocks[0] == HOLE and HOLE not in seq.window.blocks[1:]
    assert kv.window_manager.used == 2 and kv.used == 3
    for t in range(10, 30):  # decoding: the windowed table keeps two or three blocks
        feed(kv, seq, history, [t])
        held = [b for b in seq.window.blocks if b != HOLE]
        assert len(held) <= blocks_for(W, B) + 1
        assert held == seq.window.blocks[(len(history) - W + 1) // B :]
    assert kv.used == blocks_for(30, B)
    kv.release(seq)
    assert (kv.used, kv.window_manager.used) == (0, 0)


def evict(manager, name):
    """Evict the cached block named `name`, as taking it for new keys would."""
    block = manager.by_name.pop(name)
    manager.name_of[block] = None
    del manager.cached[block]
    manager.empty.append(block)


def test_a_prefix_is_reused_as_far_as_the_windowed_layers_hold_its_window():
    kv = KVBlocks(16, B, window=W, window_blocks=6)
    seq, _ = kv.allocate(tokens(21), 21)
    feed(kv, seq, [], tokens(21))
    kv.release(seq)  # full blocks 0-4 named in both groups
    # A continuation at 20 attends to 15 .. 20: blocks 3 and 4, both cached.
    again, reused = kv.allocate(tokens(21) + [99], 22)
    assert reused == 20
    assert again.window.blocks[:3] == [HOLE] * 3 and HOLE not in again.window.blocks[3:]
    assert again.window.names == again.full.names and len(again.full.names) == 5
    kv.release(again)
    # Other sequences take the windowed group's blocks, least recently released
    # first: once blocks 0-3 are gone, no continuation point has its window.
    other, _ = kv.allocate(tokens(20, offset=100), 20)
    assert kv.grow(other, 20) and kv.window_manager.cached_blocks == 1
    _, reused = kv.allocate(tokens(21) + [99], 22)
    assert reused == 0


def test_a_windowed_continuation_falls_back_to_an_earlier_point_whose_window_is_cached():
    kv = KVBlocks(32, B, window=W, window_blocks=16)
    seq, _ = kv.allocate(tokens(40), 40)
    history = []
    for start in range(0, 40, 4):  # chunks of 4: at most three windowed blocks at once
        feed(kv, seq, history, tokens(40)[start : start + 4])
        assert kv.window_manager.used <= 3
    kv.release(seq)
    names = kv.full.names(tokens(40))
    evict(kv.window_manager, names[8])
    evict(kv.window_manager, names[9])
    # A continuation at 40 attends to blocks 8-9, at 36 to 7-8; at 32 to 6-7, cached.
    seq, reused = kv.allocate(tokens(40) + [99], 41)
    assert reused == 32
    assert seq.window.blocks[:6] == [HOLE] * 6 and len(seq.full.blocks) == blocks_for(41, B)
    history = tokens(32)
    feed(kv, seq, history, tokens(40)[32:] + [99])
    assert names[9] in kv.window_manager.by_name  # computed again, and named
    kv.release(seq)
    assert (kv.used, kv.window_manager.used) == (0, 0)


def test_growing_fails_whole_when_the_windowed_group_runs_short():
    kv = KVBlocks(16, B, window=W, window_blocks=2)
    a, _ = kv.allocate(tokens(16), 16)
    assert not kv.grow(a, 12)  # three windowed blocks, two in the group
    assert (len(a.full.blocks), a.window.blocks, kv.window_manager.used) == (4, [], 0)
    assert kv.grow(a, 8) and kv.window_manager.used == 2
    kv.release(a)
    assert (kv.used, kv.window_manager.used) == (0, 0)
