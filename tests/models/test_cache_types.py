"""KV caches stored as f16, bf16 or q8_0 (--cache-type) instead of the compute dtype.

The Q8_0 writer is gguf's quantizer bit for bit. Decoding from a cache of a type gives
the logits of an f32 cache that holds the values rounded to that type (gguf's Q8_0
quantizer, torch's casts): measured equal (max abs diff 0) for Qwen3, Gemma 3 and
gpt-oss, so the native kernels that read the stored form compute what dequantizing
first would; the tests allow 1e-5. Logits then drift from an f32 cache by the
storage's rounding. Measured (max abs diff over 40 positions: a prefill in two
chunks, then one-token decoding through the native attention) on tiny random models
with head_dim 32: Qwen3 (logits within ±7) f16 2.7e-3, bf16 2.2e-2, q8_0 1.0e-1;
Gemma 3 (±4.8, soft-capped, sliding-window rings) f16 2.7e-3, bf16 2.7e-2, q8_0
7.5e-2. The tests allow f16 5e-3, bf16 5e-2, q8_0 2e-1. gpt-oss's drift is no bound
to test: a rounding can send a token to other experts (q8_0 does here, and the logits
move by 1.6; f16 9.8e-3, bf16 0.19). The bundled stories260K decodes greedily to the
same 32 tokens with an f16 or bf16 cache as with f32.
"""

import queue

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers import BASE, tiny_hf_model
from in_process import llmrun

from llmrun import api, ops
from llmrun.batching import Request, Scheduler
from llmrun.errors import UnsupportedError, UsageError
from llmrun.generate import KVState, prefill, reuse_prefix
from llmrun.models import kv_cache_bytes, model_module
from llmrun.models.cache import BYTES_PER_VALUE, CACHE_TYPES, KVCache
from llmrun.sampling import SamplingParams

pytest.importorskip("transformers")
TYPES = ["f16", "bf16", "q8_0"]
TOLERANCE = {"f32": 1e-4, "f16": 5e-3, "bf16": 5e-2, "q8_0": 2e-1}
SEQ = 40
GREEDY = SamplingParams(temperature=0)


def our_model(name: str):
    hf, config = tiny_hf_model(name)
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    model.load_state_dict(hf.state_dict(), strict=False)
    if config.get("tie_word_embeddings") or name == "gemma3":
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), config


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def model(request):
    return our_model(request.param)[0]


IDS = torch.randint(0, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))


def rounded_to(cache_type: str):
    """f32 values [..., D] -> those values as a cache of `cache_type` holds them, in f32:
    for the reference, an f32 cache that stores what the typed one does."""
    if cache_type != "q8_0":
        return lambda x: x.to(CACHE_TYPES[cache_type]).float()

    def q8_0(x):
        raw = quantize(x.float().numpy(), GGMLQuantizationType.Q8_0)
        return torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).copy())

    return q8_0


def logits_of(model, cache_type, chunks=(7, 13), rounded: str | None = None) -> torch.Tensor:
    """Logits of IDS: a prefill in `chunks`, then one token at a time. With `rounded`, in
    an f32 cache whose writes are rounded to that type (rounded_to)."""
    cache = model.new_cache(1, 64, cache_type, "cpu")
    if rounded is not None:
        cache.encode = rounded_to(rounded)
    out, start = [], 0
    sizes = list(chunks) + [1] * (SEQ - sum(chunks))
    with torch.inference_mode():
        for n in sizes:
            positions = torch.arange(start, start + n)[None]
            out.append(model(IDS[:, start : start + n], positions, cache))
            start += n
    return torch.cat(out, dim=1)


def test_the_q8_0_writer_is_ggufs_quantizer_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128), dtype=np.float32) * rng.uniform(1e-3, 1e3, (64, 1))
    x = x.astype(np.float32)
    x[0, :32] = 0  # a block of zeros: scale 0
    x[1, :32] = np.arange(32) - 15.5  # max 16.5 ... and halves
    x[2, :32] = [127.0] + [k + 0.5 for k in range(-15, 16)]  # scale 1: exact ties
    x[3, :32] = 1e-30  # subnormal scale in f16
    expected = quantize(x, GGMLQuantizationType.Q8_0)
    ours = ops.quantize_q8_0(torch.from_numpy(x))
    assert ours.dtype == torch.uint8 and ours.shape == (64, 4 * 34)
    assert np.array_equal(ours.numpy(), expected)
    back = ops.dequantize_q8_0(ours)
    assert np.array_equal(back.numpy(), dequantize(expected, GGMLQuantizationType.Q8_0))
    # Through the cache: what a write stores is what gguf writes.
    cache = KVCache(1, 1, 2, 8, 128, "q8_0", "cpu")
    k = torch.from_numpy(x[:16]).reshape(1, 2, 8, 128)
    cache.update(0, k, k, torch.arange(8)[None], 0, 8)
    assert np.array_equal(cache.k[0, 0].reshape(16, -1).numpy(), expected[:16])


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_writes_round_to_nearest_even_as_torch_does(cache_type):
    cache = KVCache(1, 1, 2, 8, 32, cache_type, "cpu")
    k = torch.randn(1, 2, 8, 32)
    cache.update(0, k, -k, torch.arange(8)[None], 0, 8)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[cache_type]
    assert cache.k.dtype == dtype and torch.equal(cache.k[0], k.to(dtype))
    assert torch.equal(cache.v[0], (-k).to(dtype))


@pytest.mark.parametrize("cache_type", TYPES)
def test_logits_stay_close_to_an_f32_cache(model, cache_type):
    reference = logits_of(model, torch.float32)
    assert reference.abs().max() > 1  # logits of some size, so the tolerance means something
    logits = logits_of(model, cache_type)
    diff = (logits - reference).abs().max().item()
    assert diff < TOLERANCE[cache_type], diff
    assert diff > 0  # the storage rounds: an exact match would mean it stored f32
    expected = logits_of(model, torch.float32, rounded=cache_type)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_type", ["f32", *TYPES])
def test_chat_prefix_reuse_with_each_type(model, cache_type):
    """Turn 1 prefilled and a reply decoded token by token; turn 2 keeps the cached
    prefix and prefills only its own tokens: the logits are those of a fresh prefill
    into a cache of the same type (the same stored keys, give or take the rounding of
    keys computed one token at a time rather than in a prefill)."""
    state = KVState(model.new_cache(1, 64, cache_type, "cpu"))
    turn1 = IDS[0, :14].tolist()
    with torch.inference_mode():
        logits = prefill(model, state, turn1)
        for _ in range(6):
            logits = prefill(model, state, [int(logits.argmax())], 1)
    turn2 = state.tokens + IDS[0, 20:29].tolist()
    kept = reuse_prefix(state, turn2)
    assert kept == 20
    with torch.inference_mode():
        last = prefill(model, state, turn2[kept:], 4)
        fresh = prefill(model, KVState(model.new_cache(1, 64, cache_type, "cpu")), turn2)
    torch.testing.assert_close(last, fresh, atol=TOLERANCE[cache_type], rtol=0)


@pytest.mark.parametrize("cache_type", TYPES)
def test_sliding_window_rings_store_the_type(cache_type):
    """Gemma 3's local layers keep rings of 5 slots: stored as the type, and a decode
    past the window from a saved depth repeats (what bench does)."""
    model, _ = our_model("gemma3")
    cache = model.new_cache(1, 64, cache_type, "cpu")
    assert cache.ring_k.dtype == cache.k.dtype == CACHE_TYPES[cache_type]
    with torch.inference_mode():
        model(IDS[:, :12], torch.arange(12)[None], cache)
        saved = cache.save_windows()
        runs = []
        for _ in range(2):
            cache.restore_windows(saved)
            out = [model(IDS[:, t : t + 1], torch.tensor([[t]]), cache) for t in range(12, 20)]
            runs.append(torch.cat(out, dim=1))
    assert torch.equal(runs[0], runs[1])
    reference = logits_of(model, torch.float32)[:, 12:20]
    logits = logits_of(model, cache_type, chunks=(12,))[:, 12:20]
    torch.testing.assert_close(runs[0], logits, atol=1e-5, rtol=0)
    assert (logits - reference).abs().max() < TOLERANCE[cache_type]


@pytest.fixture(scope="module")
def gpt_oss():
    """A tiny gpt-oss (sinks; windows of 5, kept in rings, and full layers in turn) with
    head_dim 32 for q8_0's blocks, its weights frozen as the loader leaves them, and its
    logits with an f32 cache."""
    from gpt_oss_helpers import llmrun_state, tiny_gpt_oss

    hf, config = tiny_gpt_oss(head_dim=32)
    module = model_module("gpt_oss")
    model = module.Model(module.ModelArgs.from_config(config))
    model.load_state_dict(llmrun_state(hf, config))
    model.eval().requires_grad_(False)
    return model, logits_of(model, torch.float32)


@pytest.mark.parametrize("cache_type", TYPES)
def test_gpt_oss_decodes_from_the_stored_cache(native_kernels, gpt_oss, cache_type, monkeypatch):
    """gpt-oss's logits are those of an f32 cache holding the type's rounded values, and
    its decode steps read the cache as stored (the native kernel, sinks included):
    nothing is converted, in full layers or rings, past the window."""
    model, reference = gpt_oss
    assert reference.abs().max() > 1
    logits = logits_of(model, cache_type)
    assert (logits - reference).abs().max() > 0  # the storage rounds
    expected = logits_of(model, torch.float32, rounded=cache_type)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    cache = model.new_cache(1, 64, cache_type, "cpu")
    assert cache.window == 5
    with torch.inference_mode():
        model(IDS[:, :20], torch.arange(20)[None], cache)

        def converted(x, dtype):
            raise AssertionError(f"a decode step converted {tuple(x.shape)} of the cache")

        monkeypatch.setattr(ops, "stored_values", converted)
        for t in range(20, 30):
            model(IDS[:, t : t + 1], torch.tensor([[t]]), cache)


@pytest.fixture(scope="module")
def stories():
    return {t: api.load(None, device="cpu", ctx_size=256, cache_type=t) for t in ("f16", "bf16")}


def greedy(engine, prompt, n):
    return [r.token for r in engine.generate(prompt, GREEDY, n)]


def text_of(engine, prompt, n):
    return "".join(r.text for r in engine.generate(prompt, GREEDY, n))


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_stories260k_greedy_tokens_equal_f32(stories, cache_type):
    f32 = api.load(None, device="cpu", ctx_size=256)
    prompt = f32.tokenizer.encode("Once upon a time, there was a little")
    expected = greedy(f32, prompt, 32)
    engine = stories[cache_type]
    assert engine.new_state(8).cache.k.dtype == CACHE_TYPES[cache_type]
    assert greedy(engine, prompt, 32) == expected


def test_batched_serving_equals_alone_with_an_f16_cache(stories):
    engine = stories["f16"]
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    scheduler = Scheduler(engine, parallel=3, queue=4)
    assert scheduler.cache.k.dtype == torch.float16
    events = [queue.Queue() for _ in prompts]
    for p, q in zip(ids, events, strict=True):
        scheduler.submit(Request(p, GREEDY, 24), q.put)
    scheduler.start()
    try:
        for p, q in zip(ids, events, strict=True):
            pieces = []
            while True:
                event = q.get(timeout=60)
                assert not isinstance(event, Exception), event
                pieces.append(event.text)
                if event.finish_reason is not None:
                    break
            assert "".join(pieces) == text_of(engine, p, 24)
    finally:
        scheduler.close()


def test_q8_0_needs_head_dim_a_multiple_of_32():
    # stories260K: head_dim 8
    with pytest.raises(
        UnsupportedError, match="q8_0 KV cache needs head_dim to be a multiple of 32"
    ):
        api.load(None, device="cpu", cache_type="q8_0")
    with pytest.raises(UsageError, match="unknown --cache-type 'q4_0'"):
        api.load(None, device="cpu", cache_type="q4_0")


def test_kv_bytes_follow_the_cache_type():
    _, config = tiny_hf_model("qwen3")
    f32 = kv_cache_bytes(config, 64)
    assert kv_cache_bytes(config, 64, BYTES_PER_VALUE["f16"]) == f32 // 2
    assert kv_cache_bytes(config, 64, BYTES_PER_VALUE["q8_0"]) == f32 // 4 // 32 * 34
    model, _ = our_model("qwen3")
    for cache_type, per_value in BYTES_PER_VALUE.items():
        assert model.new_cache(1, 64, cache_type, "cpu").nbytes == kv_cache_bytes(
            config, 64, per_value
        )


def test_bench_records_the_cache_type_and_its_kv_bytes():
    from llmrun import bench

    base = dict(n_prompt=[8], n_gen=[4], pg=[], depths=[4], batches=[512], threads=[None])
    records = {}
    for cache_type in (None, "f16"):
        options = bench.BenchOptions(**base, repetitions=1, device="cpu", cache_type=cache_type)
        records[cache_type] = bench.benchmark([None], options)
    for f32, f16 in zip(records[None], records["f16"], strict=True):
        assert (f32["cache_type"], f16["cache_type"]) == ("f32", "f16")
        assert f16["kv_bytes_per_token"] == f32["kv_bytes_per_token"] / 2


def test_the_cli_refuses_q8_0_for_stories260k_in_one_line():
    result = llmrun("run", "--cache-type", "q8_0", "-n", "2", "Once")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "head_dim to be a multiple of 32" in lines[0], result.stderr


def test_a_cache_type_the_device_cannot_store_is_one_clear_line(monkeypatch):
    def unsupported(x):
        raise RuntimeError("\"abs_cuda\" not implemented for 'Half'\nmore detail")

    monkeypatch.setattr(ops, "quantize_q8_0", unsupported)
    with pytest.raises(UsageError) as e:
        api._check_cache_type("q8_0", torch.device("cpu"))
    assert str(e.value) == (
        "--cache-type q8_0 is not supported on cpu: \"abs_cuda\" not implemented for 'Half'"
    )
