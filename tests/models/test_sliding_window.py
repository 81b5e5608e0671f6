"""Sliding-window layers keep only their window in the KV cache (a ring), as
llama.cpp's SWA cache does, and still give transformers' logits: prefill in chunks
longer and shorter than the window, one-token decoding past it, rows of a batch at
their own positions (padded prefill too), and a chat turn that reuses the cache.
A continuation whose window was overwritten is refused and re-prefilled, never
attended wrongly.

Tolerance: 1e-4 max abs in float32, as in test_parity.py.
"""

import pytest
import torch
from helpers import BASE, tiny_hf_model

from llmrun.generate import KVState, prefill, reuse_prefix
from llmrun.models import kv_cache_bytes, model_module

pytest.importorskip("transformers")
WINDOW = 5  # helpers.CONFIGS["gemma3"]: 6 layers, the last global
SEQ = 40


@pytest.fixture(scope="module")
def gemma3():
    hf, config = tiny_hf_model("gemma3")
    module = model_module(config["model_type"])
    ours = module.Model(module.ModelArgs.from_config(config))
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.lm_head.weight = ours.model.embed_tokens.weight
    ids = torch.randint(0, BASE["vocab_size"], (3, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
    return ours.eval(), config, ids, expected


def run(model, ids, start, cache, **kwargs):
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, positions, cache, **kwargs)


def test_the_cache_keeps_only_the_window(gemma3):
    model, config, _, _ = gemma3
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    assert cache.window == WINDOW
    assert cache.ring_k.shape == (5, 1, 2, WINDOW, 32)  # five local layers
    assert cache.k.shape == (1, 1, 2, 64, 32)  # one global layer, every position
    assert cache.nbytes == kv_cache_bytes(config, 64) == 2 * 2 * 32 * 4 * (64 + 5 * WINDOW)
    # A window as long as the context needs no ring.
    assert model.new_cache(1, WINDOW, torch.float32, "cpu").window is None


@pytest.mark.parametrize("chunks", [[SEQ], [7, 3, 1, 1, 9, 19], [1] * SEQ, [12, 28], [4, 36]])
def test_prefill_in_chunks_then_decode(gemma3, chunks):
    model, _, ids, expected = gemma3
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    out, start = [], 0
    for n in chunks:
        out.append(run(model, ids[:1, start : start + n], start, cache))
        start += n
    torch.testing.assert_close(torch.cat(out, dim=1), expected[:1], atol=1e-4, rtol=0)


def test_rows_of_a_batch_at_their_own_positions(gemma3):
    """As the serving scheduler drives the cache: each row prefilled alone, rows
    decoded together in any order, then a padded prefill of two rows (`last`)."""
    model, _, ids, expected = gemma3
    cache = model.new_cache(3, 64, torch.float32, "cpu")
    lengths = [13, 3, 21]
    for row, n in enumerate(lengths):
        run(model, ids[row : row + 1, :n], 0, cache.select([row]))
    done = list(lengths)
    for step in range(8):
        order = [2, 0, 1] if step % 2 else [0, 1, 2]
        tokens = torch.tensor([[ids[r, done[r]]] for r in order])
        positions = torch.tensor([[done[r]] for r in order])
        with torch.no_grad():
            logits = model(tokens, positions, cache.select(order))
        for i, r in enumerate(order):
            torch.testing.assert_close(logits[i, 0], expected[r, done[r]], atol=1e-4, rtol=0)
            done[r] += 1
    # Rows 0 and 2 with 3 and 7 new tokens, padded to 7 (positions clamped at the end).
    parts = {0: 3, 2: 7}
    tokens, positions = [], []
    for r, n in parts.items():
        new = ids[r, done[r] : done[r] + n].tolist()
        tokens.append(new + [new[-1]] * (7 - n))
        positions.append([min(done[r] + i, 63) for i in range(7)])
    last = torch.tensor([n - 1 for n in parts.values()])
    with torch.no_grad():
        logits = model(
            torch.tensor(tokens), torch.tensor(positions), cache.select([0, 2]), last=last
        )
    for i, (r, n) in enumerate(parts.items()):
        done[r] += n
        torch.testing.assert_close(logits[i, 0], expected[r, done[r] - 1], atol=1e-4, rtol=0)
    # The padding was never stored: both rows decode on correctly.
    tokens = torch.tensor([[ids[0, done[0]]], [ids[2, done[2]]]])
    positions = torch.tensor([[done[0]], [done[2]]])
    with torch.no_grad():
        logits = model(tokens, positions, cache.select([0, 2]))
    torch.testing.assert_close(logits[0, 0], expected[0, done[0]], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1, 0], expected[2, done[2]], atol=1e-4, rtol=0)


def fresh_logits(model, tokens):
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    return run(model, torch.tensor([tokens]), 0, cache)


def test_a_chat_turn_reuses_the_cache_past_the_window(gemma3):
    """Turn 1: a prompt longer than the window and a reply decoded token by token;
    turn 2 extends it, keeps the whole cached prefix and prefills only its own
    tokens: the logits are those of a fresh prefill of the whole turn."""
    model, _, ids, _ = gemma3
    state = KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    turn1 = ids[0, :14].tolist()
    with torch.inference_mode():
        logits = prefill(model, state, turn1)
        for _ in range(6):  # the reply, greedy, one token at a time
            logits = prefill(model, state, [int(logits.argmax())], 1)
    reply = state.tokens[14:]
    turn2 = turn1 + reply + ids[1, :9].tolist()
    kept = reuse_prefix(state, turn2)
    assert kept == len(turn1) + len(reply) == 20
    with torch.inference_mode():
        last = prefill(model, state, turn2[kept:], 4)  # chunks shorter than the window
    torch.testing.assert_close(last, fresh_logits(model, turn2)[0, -1], atol=1e-4, rtol=0)


def continue_and_compare(model, state, prompt):
    kept = reuse_prefix(state, prompt)
    positions = torch.arange(kept, len(prompt))[None]
    with torch.no_grad():
        logits = model(torch.tensor([prompt[kept:]]), positions, state.cache)
    state.tokens.extend(prompt[kept:])
    expected = fresh_logits(model, prompt)[:, kept:]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    return kept


def test_a_prefix_that_lost_its_window_is_prefilled_again(gemma3):
    model, _, ids, _ = gemma3
    state = KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    first = ids[0, :20].tolist()
    assert continue_and_compare(model, state, first) == 0
    # Back by one token (a reply re-tokenized differently at its end): the window
    # of position 19 is still there.
    assert continue_and_compare(model, state, first[:19] + ids[1, :6].tolist()) == 19
    # Back by more than that, past the window: the ring overwrote positions 10 .. 14
    # needs, so the whole prompt is prefilled again.
    assert continue_and_compare(model, state, first[:15] + ids[2, :4].tolist()) == 0
    # Within the first window nothing was overwritten yet.
    short = KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    assert continue_and_compare(model, short, ids[0, :4].tolist()) == 0
    assert continue_and_compare(model, short, ids[0, :2].tolist() + ids[1, :5].tolist()) == 2


def test_a_continuation_without_its_window_is_refused(gemma3):
    model, _, ids, _ = gemma3
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    run(model, ids[:1, :20], 0, cache)
    assert cache.reusable(20) == 20 and cache.reusable(19) == 19
    assert cache.reusable(14) == 0
    with pytest.raises(RuntimeError, match="no longer hold the keys position 14 attends to"):
        run(model, ids[:1, 14:16], 14, cache)
    with pytest.raises(RuntimeError, match="position 30"):  # a gap: never written
        run(model, ids[:1, 30:31], 30, cache)


def test_saved_windows_restore_a_depth(gemma3):
    """What bench does to repeat a test from the same cached depth."""
    model, _, ids, expected = gemma3
    cache = model.new_cache(1, 64, torch.float32, "cpu")
    run(model, ids[:1, :12], 0, cache)
    saved = cache.save_windows()
    for _ in range(2):
        cache.restore_windows(saved)
        out = [run(model, ids[:1, t : t + 1], t, cache) for t in range(12, 20)]
        torch.testing.assert_close(torch.cat(out, dim=1), expected[:1, 12:20], atol=1e-4, rtol=0)
