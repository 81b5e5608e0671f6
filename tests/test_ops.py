"""llmrun.ops: each op's native path (decode_ops.c, in each kernel family) against
its torch path on the same inputs.

Tolerances: the rotary embedding is bit-exact (the same products and sums). RMSNorm
and attention sum in another order than torch, and exp is a polynomial within 2 ulp
of expf, so they agree to a few f32 ulps: rtol 1e-5 (f32 epsilon is 1.2e-7, and
the sums here run over at most 1000 terms of one sign after the exp). Attention over
a cache stored as f16, bf16 or Q8_0 is held to the same against torch on the
dequantized cache, and is the f32 kernel on it bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

from llmrun import ops


def both_paths(fn, *args, **kwargs):
    """(native result, torch result) of one op on the same inputs."""
    assert ops._native(args[0], most=None) is not None
    native = fn(*args, **kwargs)
    native_library, ops._native = ops._native, lambda *tensors, most=None: None
    try:
        reference = fn(*args, **kwargs)
    finally:
        ops._native = native_library
    return native, reference


@pytest.mark.parametrize("shape", [(1, 1, 896), (3, 5, 64), (2, 100), (1, 7)])
def test_rms_norm_matches_torch(native_kernels, shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    native, reference = both_paths(ops.rms_norm, x, w, 1e-6)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference, F.rms_norm(x, (shape[-1],), w, 1e-6))


@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(14, 64, 64), (3, 80, 80), (4, 96, 32)])
def test_rotary_is_exact(native_kernels, heads, head_dim, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(1, heads, 1, head_dim)
    cos, sin = torch.randn(1, 1, 1, rotary_dim), torch.randn(1, 1, 1, rotary_dim)
    native, reference = both_paths(ops.rotary, x, cos, sin)
    assert torch.equal(native, reference)


def test_rotary_of_several_positions_uses_torch():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    expected = x * cos + torch.cat((x[..., 4:], x[..., :4]), dim=-1) * sin
    assert torch.equal(ops.rotary(x, cos, sin), expected)


def test_silu_mul_matches_torch_over_the_whole_range(native_kernels):
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(4864) * 4, torch.tensor([-200.0, -88.0, -20.0, 0.0, 30.0, 90.0])])
    up = torch.randn_like(gate)
    native, reference = both_paths(ops.silu_mul, gate, up)
    torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("product", [ops.silu_mul, ops.gelu_tanh_mul], ids=["silu", "gelu_tanh"])
def test_a_prompts_gated_product_is_native_too(native_kernels, product, monkeypatch):
    """A prompt's rows (512 x 4864 and a tail that is no whole run of the team's) go to
    the native product in runs over the OpenMP team, not to torch."""
    torch.manual_seed(0)
    gate, up = torch.randn(512 * 4864 + 37) * 4, torch.randn(512 * 4864 + 37)
    calls = []
    monkeypatch.setattr(F, "silu", lambda x: calls.append(x) or torch.sigmoid(x) * x)
    monkeypatch.setattr(ops, "gelu_tanh", lambda x: calls.append(x))
    native = product(gate, up)
    assert not calls
    monkeypatch.undo()
    native_again, reference = both_paths(product, gate, up)
    assert torch.equal(native, native_again)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)


def cached_kv(heads: int, length: int, head_dim: int, capacity: int, scale: float = 1.0):
    """k, v [1, heads, length, head_dim] as views of a bigger cache buffer, as the KV
    cache hands them out."""
    buffer = torch.randn(2, 1, heads, capacity, head_dim) * scale
    return buffer[0, :, :, :length], buffer[1, :, :, :length]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,length",
    [(14, 2, 64, 1), (14, 2, 64, 300), (8, 8, 128, 256), (4, 1, 80, 257), (6, 3, 64, 1000)],
)
def test_attend_one_matches_torch(native_kernels, heads, kv_heads, head_dim, length):
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim)
    k, v = cached_kv(kv_heads, length, head_dim, capacity=length + 17)
    native, reference = both_paths(ops.attend_one, q, k, v)
    assert native.shape == (1, 1, heads * head_dim)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)


def test_attend_one_rescales_when_a_later_tile_holds_the_maximum(native_kernels):
    # Keys that drift along the sequence put each 256-key tile's maximum score above
    # the last one's (scores from about -50 to 50). Compared with float64: f32 scores
    # of that size carry absolute errors of ~1e-5 in either implementation.
    torch.manual_seed(0)
    q = torch.ones(1, 2, 1, 64)
    k, v = cached_kv(1, 700, 64, capacity=700)
    k += torch.linspace(-6, 6, 700)[None, None, :, None]
    native, reference = both_paths(ops.attend_one, q, k, v)
    exact = ops.attend_one(q.double(), k.double(), v.double())
    torch.testing.assert_close(native.double(), exact, rtol=0, atol=2e-5)
    torch.testing.assert_close(reference.double(), exact, rtol=0, atol=2e-5)


def test_attend_one_on_two_threads(native_kernels):
    torch.manual_seed(0)
    q = torch.randn(1, 14, 1, 64)
    k, v = cached_kv(2, 2000, 64, capacity=2048)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native, reference = both_paths(ops.attend_one, q, k, v)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)


def test_inputs_the_native_path_does_not_take_go_to_torch():
    x = torch.randn(1, 1, 64)
    assert ops._native(x.to(torch.bfloat16)) is None
    assert ops._native(torch.randn(64, 2).t()) is None
    assert ops._native(torch.randn(ops.NATIVE_MAX_VALUES + 1)) is None
    assert ops._native(x.requires_grad_()) is None
    w = torch.randn(64)
    expected = F.rms_norm(x.bfloat16(), (64,), w.bfloat16(), 1e-6)
    assert torch.equal(ops.rms_norm(x.detach().bfloat16(), w.bfloat16(), 1e-6), expected)


def test_a_module_s_parameters_go_native_where_autograd_is_off(native_kernels):
    """A model built in code (not loaded) keeps requires_grad on its parameters; with
    autograd off (torch.no_grad, inference_mode) they take the native path as a loaded
    model's do, and a call that could be differentiated keeps torch's."""
    norm = torch.nn.RMSNorm(64, eps=1e-6)
    x = torch.randn(1, 1, 64)
    assert ops._native(x, norm.weight) is None
    with torch.no_grad():
        assert ops._native(x, norm.weight) is not None
        native, reference = both_paths(ops.rms_norm, x, norm.weight, 1e-6)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        assert ops._native(x, norm.weight) is not None


def test_gated_takes_the_native_product_for_silu_only():
    torch.manual_seed(0)
    gate, up = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    assert torch.equal(ops.gated(F.silu, gate, up), ops.silu_mul(gate, up))
    assert torch.equal(ops.gated(F.gelu, gate, up), F.gelu(gate) * up)


def test_gemma_rms_norm_offset_matches_torch(native_kernels):
    """Gemma's x / rms(x) * (1 + w): the offset added in the kernel, not by a torch op."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 1152) * 3, torch.randn(1152) * 0.1
    native, reference = both_paths(ops.rms_norm, x, w, 1e-6, offset=1.0)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference, F.rms_norm(x, (1152,), 1.0 + w, 1e-6))


def test_gelu_tanh_mul_matches_torch_over_the_whole_range(native_kernels):
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(6912) * 4, torch.tensor([-200.0, -20.0, -6.0, 0.0, 6.0, 90.0])])
    up = torch.randn_like(gate)
    native, reference = both_paths(ops.gelu_tanh_mul, gate, up)
    # Far left torch's 1 + tanh(u) rounds to a few ulps of 1 (or to 0), so the products
    # there agree absolutely, not relatively.
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference, F.gelu(gate, approximate="tanh") * up)


def test_gated_takes_the_native_product_for_tanh_gelu():
    from llmrun.models.base import activation

    gate, up = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    assert activation("gelu_pytorch_tanh") is ops.gelu_tanh
    assert torch.equal(ops.gated(ops.gelu_tanh, gate, up), ops.gelu_tanh_mul(gate, up))


@pytest.mark.parametrize("softcap", [None, 50.0, 2.0])
@pytest.mark.parametrize("heads,kv_heads,length", [(8, 4, 1), (8, 4, 300), (4, 1, 513)])
def test_attend_one_scaled_and_soft_capped_matches_torch(
    native_kernels, heads, kv_heads, length, softcap
):
    """Gemma's head_dim 256, a scale other than D^-0.5 (query_pre_attn_scalar), and
    Gemma 2's tanh soft-capping of the scores, against a float64 reference."""
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, 256)
    k, v = cached_kv(kv_heads, length, 256, capacity=length + 5)
    native, reference = both_paths(ops.attend_one, q, k, v, 144**-0.5, softcap)
    scores = (q.double().view(1, kv_heads, -1, 256) @ k.double().transpose(-1, -2)) * 144**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    exact = (torch.softmax(scores, dim=-1) @ v.double()).view(1, 1, heads * 256)
    torch.testing.assert_close(native.double(), exact, rtol=0, atol=2e-5)
    torch.testing.assert_close(reference.double(), exact, rtol=0, atol=2e-5)


def stored(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    """x [..., D] as a KV cache of `cache_type` stores it."""
    if cache_type == "q8_0":
        return ops.quantize_q8_0(x)
    return x.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cache_type])


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,length,softcap",
    [(14, 2, 64, 1, None), (14, 2, 64, 300, None), (4, 1, 128, 257, None), (8, 4, 256, 513, 2.0)],
)
def test_attend_one_reads_each_cache_type(
    native_kernels, cache_type, heads, kv_heads, head_dim, length, softcap
):
    """The native op on a cache stored as f16, bf16 or Q8_0 blocks (views of a bigger
    buffer, as the cache hands them out) against torch on the dequantized cache, at
    the f32 op's tolerances; and bit for bit the f32 kernel on the dequantized cache,
    since every stored value converts to f32 exactly."""
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim)
    buffer = stored(torch.randn(2, 1, kv_heads, length + 17, head_dim), cache_type)
    k, v = buffer[0, :, :, :length], buffer[1, :, :, :length]
    native, reference = both_paths(ops.attend_one, q, k, v, None, softcap)
    keys, values = ops.stored_values(k, torch.float32), ops.stored_values(v, torch.float32)
    assert native.shape == (1, 1, heads * head_dim)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=2e-5 if softcap else 1e-6)
    assert torch.equal(native, ops.attend_one(q, keys, values, None, softcap))


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,length", [(8, 2, 64, 1), (8, 2, 64, 300), (4, 4, 32, 129)]
)
def test_attend_one_with_sinks_matches_torch(
    native_kernels, cache_type, heads, kv_heads, head_dim, length
):
    """gpt-oss's attention sinks on each cache type, against float64 torch: a softmax
    over [scores, sink] with the sink's column dropped. The sinks range from far
    below every score to far above (then they take nearly all the weight)."""
    torch.manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim)
    buffer = stored(torch.randn(2, 1, kv_heads, length + 17, head_dim), cache_type)
    k, v = buffer[0, :, :, :length], buffer[1, :, :, :length]
    sinks = torch.randn(heads) * 2
    sinks[0], sinks[-1] = -30.0, 30.0
    native, reference = both_paths(ops.attend_one, q, k, v, None, None, sinks)
    keys = ops.stored_values(k, torch.float64)
    values = ops.stored_values(v, torch.float64)
    grouped = q.double().view(1, kv_heads, heads // kv_heads, head_dim)
    scores = (grouped @ keys.transpose(-1, -2)) * head_dim**-0.5
    sink = sinks.double().view(1, kv_heads, -1, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :length]
    exact = (weights @ values).view(1, 1, heads * head_dim)
    assert native.shape == (1, 1, heads * head_dim)
    torch.testing.assert_close(native.double(), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reference.double(), exact, rtol=1e-5, atol=1e-6)
    assert exact[0, 0, -head_dim:].abs().max() < 1e-9  # the +30 sink took the weight
    without = ops.attend_one(q, k, v)
    assert (native - without).abs().max() > 1e-2  # the sinks changed the result


def causal_reference(q, k, v, start, scale=None, softcap=None, window=0, sinks=None):
    """float64 causal attention of q [1, H, T, D] at positions start .. start + T - 1 over
    k/v [1, Hkv, start + T, D] (as stored: dequantized first), [1, T, H * D]; with a
    sliding window, query p seeing keys p - window + 1 .. p; sinks [H] as one more score
    column of each head, dropped after the softmax."""
    keys, values = ops.stored_values(k, torch.float64), ops.stored_values(v, torch.float64)
    heads, tokens, head_dim = q.shape[1], q.shape[2], q.shape[3]
    keys = keys.repeat_interleave(heads // k.shape[1], 1)
    values = values.repeat_interleave(heads // k.shape[1], 1)
    scores = (q.double() @ keys.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    seen = torch.ones(tokens, start + tokens, dtype=torch.bool).tril(start)
    if window:
        seen &= ~torch.ones_like(seen).tril(start - window)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, heads, 1, 1).expand(1, heads, tokens, 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., : start + tokens]
    return (weights @ values).transpose(1, 2).reshape(1, tokens, heads * head_dim)


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tokens,start",
    [(14, 2, 64, 100, 0), (14, 2, 64, 37, 300), (8, 8, 128, 61, 5), (12, 4, 64, 1, 40),
     (4, 1, 256, 130, 0)],
)  # fmt: skip
def test_attend_prompt_matches_float64_causal_attention(
    native_kernels, cache_type, heads, kv_heads, head_dim, tokens, start
):
    """A prompt's queries at positions start .. start + T - 1 over the cache (views of a
    bigger buffer, stored as each cache type): blocks of tokens that fill no task, key
    tiles cut by the causal diagonal, a cached prefix. Within 2e-5 of float64 (scores of
    up to ~40 carry absolute errors of ~1e-5 in f32, as for attend_one)."""
    torch.manual_seed(tokens)
    q = torch.randn(1, heads, tokens, head_dim)
    buffer = stored(torch.randn(2, 1, kv_heads, start + tokens + 17, head_dim), cache_type)
    k, v = buffer[0, :, :, : start + tokens], buffer[1, :, :, : start + tokens]
    y = ops.attend_prompt(q, k, v, start)
    assert y is not None and y.shape == (1, tokens, heads * head_dim)
    torch.testing.assert_close(y.double(), causal_reference(q, k, v, start), rtol=0, atol=2e-5)


@pytest.mark.parametrize("softcap", [50.0, 2.0])
def test_attend_prompt_scaled_and_soft_capped(native_kernels, softcap):
    torch.manual_seed(1)
    q = torch.randn(1, 8, 70, 256)
    k, v = cached_kv(4, 90, 256, capacity=100)
    y = ops.attend_prompt(q, k, v, 20, 144**-0.5, softcap)
    exact = causal_reference(q, k, v, 20, 144**-0.5, softcap)
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-5)


@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
@pytest.mark.parametrize(
    "heads,kv_heads,tokens,start,window",
    [(8, 1, 200, 0, 128), (16, 2, 90, 0, 5), (12, 4, 61, 300, 40), (4, 4, 130, 7, 1),
     (64, 8, 150, 0, 128)],
)  # fmt: skip
def test_attend_prompt_with_a_sliding_window(
    native_kernels, cache_type, heads, kv_heads, tokens, start, window
):
    """Each query sees its last `window` positions (Gemma 2/3, gpt-oss's 128, windows
    shorter than a block of tokens or a key tile, so rows that see no key of a tile,
    down to a window of one), with a cached prefix too, against float64."""
    torch.manual_seed(window)
    q = torch.randn(1, heads, tokens, 64)
    buffer = stored(torch.randn(2, 1, kv_heads, start + tokens, 64), cache_type)
    k, v = buffer[0], buffer[1]
    y = ops.attend_prompt(q, k, v, start, window=window)
    exact = causal_reference(q, k, v, start, window=window)
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-5)
    if window == 1:  # each query sees itself alone: its own value
        values = ops.stored_values(v, torch.float32).repeat_interleave(heads // kv_heads, 1)
        mine = values[:, :, start:].transpose(1, 2).reshape(1, tokens, -1)
        torch.testing.assert_close(y, mine, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [0, 128])
def test_attend_prompt_with_sinks(native_kernels, window):
    """gpt-oss's attention sinks (64 query heads, 8 KV heads, the 20B model's shapes):
    far below every score, far above (the sink takes nearly all the weight) and in
    between, on full and windowed layers, against float64."""
    torch.manual_seed(2)
    q = torch.randn(1, 64, 300, 64)
    k, v = cached_kv(8, 300, 64, capacity=300)
    sinks = torch.randn(64) * 2
    sinks[0], sinks[-1] = -30.0, 30.0
    y = ops.attend_prompt(q, k, v, 0, 0.125, window=window, sinks=sinks)
    exact = causal_reference(q, k, v, 0, 0.125, window=window, sinks=sinks)
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=2e-5)
    assert exact[0, :, -64:].abs().max() < 1e-9  # the +30 sink took the weight
    without = ops.attend_prompt(q, k, v, 0, 0.125, window=window)
    assert (y - without).abs().max() > 1e-2


def test_attend_prompt_leaves_what_it_cannot_take_to_torch(native_kernels):
    q = torch.randn(1, 4, 3, 64)
    k, v = cached_kv(2, 5, 64, capacity=8)
    assert ops.attend_prompt(q, k, v, 2) is not None
    assert ops.attend_prompt(q, k, v, 1) is None  # keys other than start + T
    assert ops.attend_prompt(torch.randn(2, 4, 3, 64), k.expand(2, -1, -1, -1), v, 2) is None
    q, (k, v) = torch.randn(1, 4, 3, 40), cached_kv(2, 5, 40, capacity=8)
    assert ops.attend_prompt(q, k, v, 2) is None  # rows of 40: not whole vector pairs
