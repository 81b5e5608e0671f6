"""The static decode step (llmrun.static_decode), which CUDA graphs capture, run on
CPU: its logits equal the ordinary forward's for every family it takes (a Mistral
sliding window included), eager and through torch.compile; the families and caches
it cannot take are left to the ordinary forward; a compiled step that fails falls
back to it with one note."""

import shutil

import pytest
import torch
from helpers import BASE
from test_cache_types import our_model

from llmrun import static_decode
from llmrun.models.paged import PagedKVCache

STATIC = ["llama", "mistral", "qwen2", "qwen3", "phi3"]
IDS = torch.randint(0, BASE["vocab_size"], (1, 18), generator=torch.Generator().manual_seed(3))
PROMPT = 6
# The same bf16 ops, fused and reordered, as a fraction of the logits' span (±6 here).
# Measured on qwen2: compiled and eager 2.1% apart, each 3% from the f32 logits.
BF16_TOLERANCE = 0.04


def decode_logits(model, decode, cache) -> torch.Tensor:
    """A prompt through the ordinary forward, then one token at a time through `decode`,
    each attending to its bucket of the cache (buckets of 8, 16 and 32 here)."""
    with torch.inference_mode():
        out = [model(IDS[:, :PROMPT], torch.arange(PROMPT)[None], cache)[0, -1]]
        for p in range(PROMPT, IDS.shape[1]):
            length = static_decode.bucket(p, cache.max_seq_len)
            out.append(decode(IDS[:, p : p + 1], torch.tensor([[p]]), length)[0, -1])
    return torch.stack(out)


def ordinary(model, cache):
    return lambda ids, positions, length: model(ids, positions, cache)


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(static_decode, "FIRST_BUCKET", 8)


def test_a_bucket_holds_the_position_within_twice_its_keys():
    assert [static_decode.bucket(p, 32) for p in (0, 7, 8, 15, 16, 31)] == [8, 8, 16, 16, 32, 32]
    assert static_decode.bucket(40, 48) == 48  # the whole cache, past the last power of two


@pytest.mark.parametrize("name", STATIC)
def test_the_static_step_gives_the_ordinary_logits(name):
    model, _ = our_model(name)
    static_cache = model.new_cache(1, 32, torch.float32, "cpu")
    assert static_decode.supported(model, static_cache)
    got = decode_logits(model, static_decode.step(model, static_cache), static_cache)
    cache = model.new_cache(1, 32, torch.float32, "cpu")
    expected = decode_logits(model, ordinary(model, cache), cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static_cache.k[:, :, :, :18], cache.k[:, :, :, :18])


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU generates C++ and needs a C++ compiler",
)
def test_the_compiled_static_step_gives_the_eager_logits():
    """In bf16, as on a GPU: the ops take their torch paths (the native kernels are f32
    and CPU only), which torch.compile traces whole."""
    model, _ = our_model("qwen2")
    model = model.to(torch.bfloat16)
    cache = model.new_cache(1, 32, torch.bfloat16, "cpu")
    compiled = torch.compile(static_decode.step(model, cache), fullgraph=True)
    got = decode_logits(model, compiled, cache)
    reference = model.new_cache(1, 32, torch.bfloat16, "cpu")
    expected = decode_logits(model, static_decode.step(model, reference), reference)
    torch.testing.assert_close(
        got, expected, rtol=0, atol=BF16_TOLERANCE * expected.abs().max().item()
    )


def test_what_the_static_step_cannot_take_is_left_to_the_forward():
    gemma, _ = our_model("gemma3")  # rings and frames of its own
    assert not static_decode.supported(gemma, gemma.new_cache(1, 32, torch.float32, "cpu"))
    model, _ = our_model("qwen2")
    assert not static_decode.supported(model, model.new_cache(2, 32, torch.float32, "cpu"))
    pool = PagedKVCache(model.new_cache(1, 1, "f32", "cpu"), 4, 16, 64)
    assert not static_decode.supported(model, pool.view([[0]]))
    # Off CUDA, decoding takes the ordinary forward.
    assert static_decode.decoder(model, model.new_cache(1, 32, torch.float32, "cpu")) is None


def test_a_failing_compiled_step_falls_back_to_the_forward_with_one_note(capsys):
    model, _ = our_model("qwen2")
    cache = model.new_cache(1, 32, torch.float32, "cpu")

    def broken(ids, positions, length):
        raise RuntimeError("CUDA graphs need static inputs\nmore detail")

    decode = static_decode._guarded(broken, model, cache)
    got = decode_logits(model, decode, cache)
    reference = model.new_cache(1, 32, torch.float32, "cpu")
    expected = decode_logits(model, ordinary(model, reference), reference)
    torch.testing.assert_close(got, expected)
    assert capsys.readouterr().err == (
        "note: CUDA graph decoding failed (CUDA graphs need static inputs); decoding eagerly\n"
    )


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU generates C++ and needs a C++ compiler",
)
def test_generate_decodes_through_the_compiled_step_where_it_is_on(monkeypatch, capsys):
    """generate.decode as on CUDA (the device check let through for the CPU): the step
    compiled with mode="reduce-overhead" (no graphs off CUDA) once per cache, a
    compile per bucket, in bf16; the tokens' logits are the eager step's."""
    from llmrun.generate import KVState, decode

    monkeypatch.setattr(static_decode, "DEVICES", ("cuda", "cpu"))
    model, _ = our_model("qwen2")
    model = model.to(torch.bfloat16)
    state = KVState(model.new_cache(1, 32, torch.bfloat16, "cpu"))
    with torch.inference_mode():
        model(IDS[:, :PROMPT], torch.arange(PROMPT)[None], state.cache)
        state.tokens = IDS[0, :PROMPT].tolist()
        got = torch.stack([decode(model, state, t) for t in IDS[0, PROMPT:].tolist()])
    assert state.cache.static_step is static_decode.decoder(model, state.cache)
    assert "note:" not in capsys.readouterr().err  # compiled, not fallen back to eager
    reference = model.new_cache(1, 32, torch.bfloat16, "cpu")
    expected = decode_logits(model, static_decode.step(model, reference), reference)[1:]
    torch.testing.assert_close(
        got, expected, rtol=0, atol=BF16_TOLERANCE * expected.abs().max().item()
    )
