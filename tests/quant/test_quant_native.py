"""Native kernels (kernels.c) against gguf's numpy reference, and their fallback."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_quant_blocks import assert_same_bits
from test_quant_linear import TYPES, assert_close_matmul, finite_blocks, reference

from llmrun.quant import native
from llmrun.quant.blocks import SUPPORTED_TYPES

T = GGMLQuantizationType

needs_native = pytest.mark.skipif(not native.available(), reason=native.status())


def test_every_supported_type_has_a_kernel():
    assert set(TYPES) == set(SUPPORTED_TYPES)


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_native_dequantize_is_bit_exact_with_gguf(ggml_type: T):
    raw = finite_blocks(ggml_type, 9, 768, seed=11)
    got = native.dequantize(torch.from_numpy(raw), ggml_type)
    assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 11])
def test_native_matvec_matches_f32_matmul(ggml_type: T, m: int):
    raw = finite_blocks(ggml_type, 33, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(12))
    y = native.matvec(torch.from_numpy(raw), ggml_type, x)
    assert y.shape == (m, 33)
    assert_close_matmul(y, x, reference(raw, ggml_type))


@needs_native
@pytest.mark.parametrize("ggml_type", list(native.PACKED), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_packed_kernels_match_f32_matmul(ggml_type: T, m: int):
    raw = finite_blocks(ggml_type, 40, 1024, seed=16)
    packed = native.pack(torch.from_numpy(raw), ggml_type)
    assert native.supports(ggml_type, 1024, True) and not native.supports(ggml_type, 96, True)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(17))
    y = native.matvec(packed, ggml_type, x, packed=True)
    assert_close_matmul(y, x, reference(raw, ggml_type))
    got = native.dequantize(packed, ggml_type, packed=True)
    assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))


@needs_native
def test_native_kernels_take_rows_with_a_stride():
    raw = torch.from_numpy(finite_blocks(T.Q4_K, 12, 512, seed=13))
    x = torch.randn(1, 512)
    every_other = raw[::2]
    assert every_other.stride(0) == 2 * raw.shape[1]
    assert torch.equal(native.dequantize(every_other, T.Q4_K), native.dequantize(raw, T.Q4_K)[::2])
    assert_close_matmul(
        native.matvec(every_other, T.Q4_K, x), x, reference(raw.numpy(), T.Q4_K)[::2]
    )


@needs_native
def test_native_refuses_rows_it_cannot_take():
    assert native.supports(T.F16, 64) and not native.supports(T.F16, 37)
    with pytest.raises(ValueError, match="F16 rows of 37"):
        native.matvec(torch.zeros(2, 74, dtype=torch.uint8), T.F16, torch.zeros(1, 37))
    with pytest.raises(ValueError, match="f32"):
        native.matvec(torch.zeros(2, 34, dtype=torch.uint8), T.Q8_0, torch.zeros(1, 32).half())


@pytest.mark.parametrize(
    "env, reason", [({"LLMRUN_NATIVE": "0"}, "LLMRUN_NATIVE=0"), ({"CC": "/nonexistent/cc"}, "")]
)
def test_without_kernels_the_status_says_why(env: dict, reason: str, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    native._library.cache_clear()
    native.supports.cache_clear()
    try:
        assert not native.available()
        assert not native.supports(T.Q4_0, 32)
        assert native.status().startswith("torch fallback: ") and reason in native.status()
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
        native.supports.cache_clear()
