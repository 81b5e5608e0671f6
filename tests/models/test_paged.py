"""The paged KV cache (llmrun.models.paged) against the contiguous one.

The native paged kernel is held to torch's attention on the same keys and values
laid out contiguously, at test_ops.py's tolerances (rtol 1e-5: the same sums in
another order), for shuffled block tables, partial last blocks and sliding-window
ranges, in every cache type. Whole models (dense, mixtures of experts, gpt-oss) are
held to the contiguous KVCache: the same logits to float rounding (1e-4 on logits
within about ±5) for a prefill in chunks and then decoding, alone and batched, with
rows whose tables share their prefix blocks. In an f16 cache, 1e-7 differences upstream (keys summed in another
order) can round a stored key the other way, one f16 step: up to 3e-4 measured on
Gemma 2, so f16 is held to 2e-3.
"""

import os
import random

import pytest
import torch
import torch.nn.functional as F
from gpt_oss_helpers import llmrun_state, tiny_gpt_oss
from helpers import BASE
from moe_helpers import MOE_CONFIGS, hub_state_dict, tiny_moe_model
from test_cache_types import our_model

from llmrun import ops
from llmrun.kv_blocks import HOLE, KVBlocks
from llmrun.models import model_module
from llmrun.models.paged import PagedKVCache

BLOCK = 16


def stored(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    if cache_type == "q8_0":
        return ops.quantize_q8_0(x)
    return x.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cache_type])


def scatter(contiguous: torch.Tensor, table: list[int], n_blocks: int) -> torch.Tensor:
    """[Hkv, L, W] keys laid out in a pool [n_blocks, Hkv, BLOCK, W] by `table`, the
    rest of the pool random."""
    heads, length, width = contiguous.shape
    pool = torch.randint(0, 255, (n_blocks, heads, BLOCK, width), dtype=torch.uint8)
    pool = (
        pool.view(contiguous.dtype) if contiguous.dtype.itemsize == 1 else pool.to(contiguous.dtype)
    )
    for p in range(length):
        pool[table[p // BLOCK], :, p % BLOCK] = contiguous[:, p]
    return pool


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,length,first,softcap",
    [
        (4, 2, 64, 1, 0, None),
        (4, 2, 64, 37, 0, None),  # a partial last block
        (14, 2, 64, 300, 0, None),
        (8, 4, 32, 100, 61, None),  # a sliding window starting inside a block
        (8, 4, 256, 64, 0, 2.0),  # full blocks only, soft-capped
    ],
)
def test_paged_kernel_matches_torch_on_the_contiguous_keys(
    native_kernels, cache_type, heads, kv_heads, head_dim, length, first, softcap
):
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim)
    k = stored(torch.randn(kv_heads, length, head_dim), cache_type)
    v = stored(torch.randn(kv_heads, length, head_dim), cache_type)
    n_blocks = -(-length // BLOCK) + 5
    table = random.Random(length).sample(range(n_blocks), n_blocks)  # shuffled, spare blocks too
    k_pool, v_pool = scatter(k, table, n_blocks), scatter(v, table, n_blocks)
    tables = torch.tensor(table, dtype=torch.int32)
    scale = head_dim**-0.5
    out = ops.attend_paged(q, k_pool, v_pool, tables, first, length, scale, softcap)
    keys = ops.stored_values(k[:, first:length], torch.float32)[None]
    values = ops.stored_values(v[:, first:length], torch.float32)[None]
    if softcap is None:
        reference = F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    else:
        grouped = keys.repeat_interleave(heads // kv_heads, 1)
        scores = torch.tanh(q @ grouped.transpose(-1, -2) * scale / softcap) * softcap
        reference = torch.softmax(scores, -1) @ values.repeat_interleave(heads // kv_heads, 1)
    reference = reference.transpose(1, 2).reshape(1, 1, heads * head_dim)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=2e-5 if softcap else 1e-6)


def test_the_kernel_refuses_what_it_cannot_take(native_kernels):
    q = torch.randn(1, 2, 1, 64)
    pool = torch.zeros(2, 1, BLOCK, 64)
    table = torch.zeros(2, dtype=torch.int32)
    assert ops.attend_paged(q, pool, pool, table, 5, 5, 1.0) is None  # an empty range
    assert ops.attend_paged(q, pool, pool, table.long(), 0, 5, 1.0) is None
    assert ops.attend_paged(q.double(), pool, pool, table, 0, 5, 1.0) is None
    # a table entry outside the pool of 2 blocks, or a table too short for the keys:
    # the native kernel would read outside the pool
    for bad in (2, -1):
        outside = torch.tensor([0, bad], dtype=torch.int32)
        assert ops.attend_paged(q, pool, pool, outside, 0, BLOCK + 1, 1.0) is None
    assert ops.attend_paged(q, pool, pool, table[:1], 0, BLOCK + 1, 1.0) is None
    assert ops.attend_paged(q, pool, pool, table, 0, BLOCK + 1, 1.0) is not None


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
FAMILIES += [*MOE_CONFIGS, "gpt_oss"]  # experts; gpt-oss's sinks, windows of 5
SEQ = 45
IDS = torch.randint(0, BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
SHARED = 32  # row 1 starts with row 0's first two blocks


def built(name: str):
    """Our model of a tiny transformers model of the family, with its weights."""
    if name in MOE_CONFIGS:
        hf, config = tiny_moe_model(name)
        state = hub_state_dict(hf, config["model_type"])
    elif name == "gpt_oss":
        hf, config = tiny_gpt_oss()
        state = llmrun_state(hf, config)
    else:
        return our_model(name)[0]
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return built(request.param)


def pool_for(model, cache_type="f32", n_blocks=16):
    return PagedKVCache(model.new_cache(1, 1, cache_type, "cpu"), n_blocks, BLOCK, 256)


def contiguous_logits(model, ids, sizes, cache_type="f32"):
    cache = model.new_cache(1, 64, cache_type, "cpu")
    out, start = [], 0
    for n in sizes:
        positions = torch.arange(start, start + n)[None]
        out.append(model(ids[None, start : start + n], positions, cache)[0])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_one_sequence_on_shuffled_blocks_gives_the_contiguous_logits(model, cache_type):
    # A prefill in chunks that end inside blocks, then decoding that fills a partial
    # block and goes on into the next.
    sizes = [7, 20] + [1] * 8
    pool = pool_for(model, cache_type)
    table = [9, 2, 14]  # 35 positions: two full blocks and 3 of a third
    out, start = [], 0
    with torch.inference_mode():
        reference = contiguous_logits(model, IDS[0], sizes, cache_type)
        for n in sizes:
            positions = torch.arange(start, start + n)[None]
            out.append(model(IDS[:1, start : start + n], positions, pool.view([table]))[0])
            start += n
    tolerance = 1e-4 if cache_type == "f32" else 2e-3
    torch.testing.assert_close(torch.cat(out), reference, rtol=tolerance, atol=tolerance)


def test_one_sequences_prompt_takes_the_native_attention(model, monkeypatch):
    """A prefill in chunks on shuffled blocks reads them as stored into ops.attend_prompt
    (windows and sinks included), answering as torch's attention does on them."""
    sizes = [7, 20]
    table = [9, 2]

    def logits() -> torch.Tensor:
        pool, out, start = pool_for(model), [], 0
        with torch.inference_mode():
            for n in sizes:
                positions = torch.arange(start, start + n)[None]
                out.append(model(IDS[:1, start : start + n], positions, pool.view([table]))[0])
                start += n
        return torch.cat(out)

    taken = []
    real = ops.attend_prompt
    monkeypatch.setattr(
        ops, "attend_prompt", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    )
    native = logits()
    assert taken and all(y is not None for y in taken)
    monkeypatch.setattr(ops, "attend_prompt", lambda *a, **k: None)
    torch.testing.assert_close(native, logits(), rtol=1e-5, atol=1e-5)


def test_rows_prefilled_together_take_the_native_attention(model, monkeypatch):
    """serve's prefill of two rows in one forward (their chunks of 6 and 9 tokens after
    prefixes of 16 and 9, the shorter padded by repeating its last position), row by row
    through ops.attend_prompt: each row's last logits as through torch's attention."""
    tables, starts, counts = [[3, 8, 1], [6, 2, 12]], [16, 9], [6, 9]

    def logits() -> torch.Tensor:
        pool = pool_for(model)
        with torch.inference_mode():
            for row, start in enumerate(starts):
                prefix = IDS[row : row + 1, :start]
                model(prefix, torch.arange(start)[None], pool.view(tables[row : row + 1]))
            ids = torch.stack([IDS[r, s : s + 9] for r, s in enumerate(starts)])
            positions = torch.tensor(
                [[s + min(i, c - 1) for i in range(9)] for s, c in zip(starts, counts, strict=True)]
            )
            last = torch.tensor(counts) - 1
            return model(ids, positions, pool.view(tables, counts), last=last)[:, -1]

    taken = []
    real = ops.attend_prompt

    def spy(q, *args, **kwargs):
        y = real(q, *args, **kwargs)
        taken.append((q.shape[2], y is not None))
        return y

    monkeypatch.setattr(ops, "attend_prompt", spy)
    native = logits()
    assert {(6, True), (9, True)} <= set(taken)  # the rows' chunks, each alone
    assert all(took for _, took in taken)
    monkeypatch.setattr(ops, "attend_prompt", lambda *a, **k: None)
    torch.testing.assert_close(native, logits(), rtol=1e-5, atol=1e-5)


def test_batched_rows_sharing_prefix_blocks_give_their_own_logits(model):
    """Row 1 shares row 0's first SHARED tokens, and so its first two blocks; both
    are then prefilled together (padded on the right) and decoded together."""
    ids = IDS.clone()
    ids[1, :SHARED] = ids[0, :SHARED]
    pool = pool_for(model)
    tables = [[5, 0, 11], [5, 0, 7]]
    with torch.inference_mode():
        head = ids[:1, :SHARED]
        model(head, torch.arange(SHARED)[None], pool.view(tables[:1]))
        # The rest of the prompts: 6 and 9 tokens, rows padded to 9.
        counts = [6, 9]
        rest = torch.stack([ids[0, SHARED : SHARED + 9], ids[1, SHARED : SHARED + 9]])
        positions = torch.arange(SHARED, SHARED + 9).expand(2, 9)
        last = torch.tensor(counts) - 1
        prefilled = model(rest, positions, pool.view(tables, counts), last=last)[:, -1]
        ends = [SHARED + c for c in counts]
        decoded = []
        for step in range(4):
            step_ids = torch.stack([ids[r, e + step : e + step + 1] for r, e in enumerate(ends)])
            step_positions = torch.tensor([[e + step] for e in ends])
            decoded.append(model(step_ids, step_positions, pool.view(tables))[:, -1])
        for row, end in enumerate(ends):
            sizes = [SHARED, end - SHARED] + [1] * 4
            reference = contiguous_logits(model, ids[row], sizes)
            torch.testing.assert_close(prefilled[row], reference[end - 1], rtol=1e-4, atol=1e-4)
            got = torch.stack([d[row] for d in decoded])
            torch.testing.assert_close(got, reference[end:], rtol=1e-4, atol=1e-4)


def test_block_bytes_counts_keys_and_values_of_every_layer():
    model, _ = our_model("qwen3")  # 2 layers, 2 KV heads of 32
    like = model.new_cache(1, 1, "f16", "cpu")
    assert PagedKVCache.block_bytes(like, BLOCK) == 2 * 2 * 2 * BLOCK * 32 * 2
    assert pool_for(model, "f16").nbytes == 16 * PagedKVCache.block_bytes(like, BLOCK)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_pool_is_resident_only_where_blocks_are_written():
    """serve's pool (64 MiB here) costs memory as its blocks fill, not all at once; it
    reads as zeros before it is written."""

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    model, _ = our_model("qwen3")  # 2 layers, 2 KV heads of 32: 16 KiB a block in f32
    before = resident()
    pool = pool_for(model, n_blocks=4096)
    assert pool.nbytes == 64 << 20
    assert resident() - before < 8 << 20
    assert not pool.k[:, :8].any() and not pool.v[:, -8:].any()
    with torch.inference_mode():
        model(IDS[:1], torch.arange(SEQ)[None], pool.view([[7, 4000, 12]]))
    assert pool.k[:, 4000].any()
    assert resident() - before < 16 << 20


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss"])
def test_windowed_layers_in_a_pool_of_their_own_give_the_contiguous_logits(name):
    """serve's bookkeeping (KVBlocks) for two rows whose windowed layers (window 5)
    share a pool of 5 blocks: their tables let go of blocks as they leave the window,
    the other row takes them, and every block no table holds is scribbled over
    before each forward, so a key read from outside the window would show."""
    model = built(name)
    like = model.new_cache(1, 1, "f32", "cpu")
    pool = PagedKVCache(like, 16, BLOCK, 256, window_blocks=5)
    assert pool.window_k is not None and 0 < pool.window_k.shape[0] < len(like.windows)
    kv = KVBlocks(16, BLOCK, window=5, window_blocks=5)
    ids = IDS.clone()
    prompts, chunks, steps = [20, 30], [[7, 13], [20, 10]], 10
    seqs = [kv.allocate(ids[r, : prompts[r]].tolist(), prompts[r])[0] for r in range(2)]
    fed = [[], []]
    got = [[], []]
    generator = torch.Generator().manual_seed(0)

    def forward(counts):
        held = {b for s in seqs for b in s.window.blocks if b != HOLE}
        for b in set(range(5)) - held:
            for cache in (pool.window_k, pool.window_v):
                cache[:, b] = 100 * torch.randn(cache[:, b].shape, generator=generator)
        width = max(counts)
        rows, positions = [], []
        for r, n in enumerate(counts):
            start = len(fed[r])
            assert kv.grow(seqs[r], start + n)
            part = ids[r, start : start + n].tolist()
            rows.append(part + [part[-1]] * (width - n))
            positions.append([start + min(i, n - 1) for i in range(width)])
        view = pool.view(
            [s.full.blocks for s in seqs],
            counts if min(counts) < width else None,
            [s.window.blocks for s in seqs],
        )
        last = torch.tensor(counts) - 1
        logits = model(torch.tensor(rows), torch.tensor(positions), view, last=last)[:, -1]
        for r, n in enumerate(counts):
            fed[r].extend(ids[r, len(fed[r]) : len(fed[r]) + n].tolist())
            kv.commit(seqs[r], fed[r])
            got[r].append(logits[r])

    with torch.inference_mode():
        for counts in zip(*chunks, strict=True):
            forward(list(counts))
        for _ in range(steps):
            forward([1, 1])
        assert any(HOLE in s.window.blocks for s in seqs)
        for r in range(2):
            sizes = chunks[r] + [1] * steps
            reference = contiguous_logits(model, ids[r], sizes)
            ends = torch.tensor(sizes).cumsum(0) - 1
            torch.testing.assert_close(torch.stack(got[r]), reference[ends], rtol=1e-4, atol=1e-4)
    for s in seqs:
        kv.release(s)
    assert (kv.used, kv.window_manager.used) == (0, 0)
