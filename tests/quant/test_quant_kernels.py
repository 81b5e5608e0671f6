"""The native kernels on GGML types (llmrun.quant.kernels; kernels_avx512.c for AVX-512,
kernels_avx2.c for AVX2, each test against every family this CPU has, see conftest.py)
against gguf's numpy reference."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_quant_blocks import assert_same_bits, every_mxfp4_block
from test_quant_linear import FAMILY_PACKED, TYPES, assert_close_matmul, finite_blocks, reference

from llmrun import native
from llmrun.quant import kernels, linear
from llmrun.quant.blocks import SUPPORTED_TYPES
from llmrun.quant.linear import QuantLinear

T = GGMLQuantizationType
AVX2_PACKED = FAMILY_PACKED["AVX2"]


def refuses_packed(ggml_type: T, family: str, n: int) -> bool:
    """Whether this family has no packed kernel for the type, after checking that it
    says so rather than running a wrong one."""
    if ggml_type in FAMILY_PACKED[family]:
        return False
    assert not kernels.supports(ggml_type, n, True)
    raw = torch.from_numpy(finite_blocks(ggml_type, 2, n, seed=1))
    with pytest.raises(ValueError, match=f"no native kernel for {ggml_type.name}"):
        kernels.matvec(raw, ggml_type, torch.zeros(1, n), packed=True)
    return True


def test_every_supported_type_has_a_kernel():
    assert set(TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_native_dequantize_is_bit_exact_with_gguf(ggml_type: T, native_kernels: str):
    raw = finite_blocks(ggml_type, 9, 768, seed=11)
    got = kernels.dequantize(torch.from_numpy(raw), ggml_type)
    assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))


def test_native_mxfp4_every_scale_and_code_is_bit_exact(native_kernels: str):
    raw = np.tile(every_mxfp4_block(), (1, 3)).reshape(64, -1)  # rows of 12 blocks
    with np.errstate(over="ignore"):
        expected = gguf_dequantize(raw, T.MXFP4).astype(np.float32)
    assert_same_bits(kernels.dequantize(torch.from_numpy(raw), T.MXFP4).numpy(), expected)


@pytest.mark.parametrize("blocks", [1, 2, 3, 15, 16, 17, 33, 90])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_native_mxfp4_rows_of_any_block_count(blocks: int, m: int, native_kernels: str):
    # The AVX-512 kernel decodes 16 blocks' scales at a time and takes blocks in pairs:
    # whole and partial groups, odd counts; 90 blocks is gpt-oss's row of 2880.
    n = 32 * blocks
    raw = finite_blocks(T.MXFP4, 9, n, seed=blocks)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(9, generator=torch.Generator().manual_seed(blocks))
    y = kernels.matvec(torch.from_numpy(raw), T.MXFP4, x)
    assert_close_matmul(y, x, reference(raw, T.MXFP4))
    assert torch.equal(kernels.matvec(torch.from_numpy(raw), T.MXFP4, x, bias=bias), y + bias)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 11, 16])
def test_native_matvec_matches_f32_matmul(ggml_type: T, m: int, native_kernels: str):
    raw = finite_blocks(ggml_type, 33, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(12))
    y = kernels.matvec(torch.from_numpy(raw), ggml_type, x)
    assert y.shape == (m, 33)
    assert_close_matmul(y, x, reference(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", list(kernels.PACKED), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("n", [128, 384, 1024])
def test_packed_kernels_match_f32_matmul(ggml_type: T, m: int, n: int, native_kernels: str):
    if GGML_QUANT_SIZES[ggml_type][0] == 256:
        n *= 2  # whole blocks
    if refuses_packed(ggml_type, native_kernels, n):
        return
    raw = finite_blocks(ggml_type, 40, n, seed=16 + m)
    packed = kernels.pack(torch.from_numpy(raw), ggml_type)
    assert kernels.supports(ggml_type, n, True) and not kernels.supports(ggml_type, n + 16, True)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(17))
    y = kernels.matvec(packed, ggml_type, x, packed=True)
    assert y.shape == (m, 40)
    assert_close_matmul(y, x, reference(raw, ggml_type))
    got = kernels.dequantize(packed, ggml_type, packed=True)
    assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))


@pytest.mark.parametrize("ggml_type", list(kernels.PACKED), ids=lambda t: t.name)
def test_packed_kernels_take_rows_with_a_stride_and_a_bias(ggml_type: T, native_kernels: str):
    if refuses_packed(ggml_type, native_kernels, 512):
        return
    raw = finite_blocks(ggml_type, 12, 512, seed=22)
    packed = kernels.pack(torch.from_numpy(raw), ggml_type)
    every_other = packed[::2]
    bias = torch.randn(6, generator=torch.Generator().manual_seed(23))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(24))
    y = kernels.matvec(every_other, ggml_type, x, packed=True, bias=bias)
    assert_close_matmul(y - bias, x, reference(raw, ggml_type)[::2])
    got = kernels.dequantize(every_other, ggml_type, packed=True)
    assert torch.equal(got, kernels.dequantize(packed, ggml_type, packed=True)[::2])


@pytest.mark.parametrize("blocks", [1, 2, 3, 16, 17, 35])
@pytest.mark.parametrize("m", [1, 3])
def test_packed_k_quant_rows_of_any_block_count(blocks: int, m: int, use_kernels):
    use_kernels("AVX-512")  # whole and partial groups of 16 scale fields
    n = 256 * blocks
    for ggml_type in (T.Q4_K, T.Q5_K):
        raw = finite_blocks(ggml_type, 7, n, seed=blocks)
        packed = kernels.pack(torch.from_numpy(raw), ggml_type)
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
        y = kernels.matvec(packed, ggml_type, x, packed=True)
        assert_close_matmul(y, x, reference(raw, ggml_type))
        got = kernels.dequantize(packed, ggml_type, packed=True)
        assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))


@pytest.mark.parametrize("ggml_type", AVX2_PACKED, ids=lambda t: t.name)
def test_avx2_kernels_repack_too(ggml_type: T, use_kernels):
    use_kernels("AVX2")
    assert kernels.supports(ggml_type, 1024) and kernels.supports(ggml_type, 1024, True)
    # Rows of 64 weights are enough here (the AVX-512 kernels step by 128); Q8_0's of 32.
    step = 32 if ggml_type == T.Q8_0 else 64
    assert kernels.supports(ggml_type, step, True)
    assert not kernels.supports(ggml_type, step + step // 2, True)
    for n in (step, 3 * step, 5 * step):
        raw = finite_blocks(ggml_type, 5, n, seed=n)
        packed = kernels.pack(torch.from_numpy(raw), ggml_type)
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
        assert_close_matmul(
            kernels.matvec(packed, ggml_type, x, True), x, reference(raw, ggml_type)
        )
        got = kernels.dequantize(packed, ggml_type, packed=True)
        assert_same_bits(got.numpy(), gguf_dequantize(raw, ggml_type).astype(np.float32))
    raw = finite_blocks(ggml_type, 8, 1024, seed=18)
    lin = QuantLinear(torch.from_numpy(raw), ggml_type, 1024)
    assert lin.packed
    for m in (1, 6):
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(19))
        assert_close_matmul(lin(x), x, reference(raw, ggml_type))


def test_avx2_kernels_leave_q4_k_unpacked(use_kernels):
    use_kernels("AVX2")
    assert kernels.supports(T.Q4_K, 256) and not kernels.supports(T.Q4_K, 256, packed=True)
    raw = finite_blocks(T.Q4_K, 8, 512, seed=25)
    lin = QuantLinear(torch.from_numpy(raw), T.Q4_K, 512)
    assert not lin.packed and torch.equal(lin.weight, torch.from_numpy(raw))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(26))
    assert_close_matmul(lin(x), x, reference(raw, T.Q4_K))


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [16, 48, 80, 272])
def test_float_rows_of_any_block_multiple(ggml_type: T, n: int, native_kernels: str):
    # Whole numbers of blocks for both families (16 and 8 weights) but not of the 32
    # or 64 weights the AVX-512 dot product steps by: kernels_avx512.c once dropped the last
    # 16 weights of such rows (48) or read past them (16, 80).
    raw = finite_blocks(ggml_type, 5, n, seed=20)
    assert kernels.supports(ggml_type, n)
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(21))
    assert_close_matmul(
        kernels.matvec(torch.from_numpy(raw), ggml_type, x), x, reference(raw, ggml_type)
    )


def test_native_kernels_take_rows_with_a_stride(native_kernels: str):
    raw = torch.from_numpy(finite_blocks(T.Q4_K, 12, 512, seed=13))
    x = torch.randn(1, 512)
    every_other = raw[::2]
    assert every_other.stride(0) == 2 * raw.shape[1]
    assert torch.equal(
        kernels.dequantize(every_other, T.Q4_K), kernels.dequantize(raw, T.Q4_K)[::2]
    )
    assert_close_matmul(
        kernels.matvec(every_other, T.Q4_K, x), x, reference(raw.numpy(), T.Q4_K)[::2]
    )


def test_native_refuses_rows_it_cannot_take(native_kernels: str):
    assert kernels.supports(T.F16, 64) and not kernels.supports(T.F16, 37)
    with pytest.raises(ValueError, match="F16 rows of 37"):
        kernels.matvec(torch.zeros(2, 74, dtype=torch.uint8), T.F16, torch.zeros(1, 37))
    with pytest.raises(ValueError, match="f32"):
        kernels.matvec(torch.zeros(2, 34, dtype=torch.uint8), T.Q8_0, torch.zeros(1, 32).half())


def f32_gemm(raw: torch.Tensor, ggml_type: T, x: torch.Tensor, packed: bool, bias=None):
    """The AVX2 family's f32 GEMM (gemm_avx2.c) called as QuantLinear's Matvec calls it,
    its return code checked: the prompt's rows must not have fallen back to the matvec."""
    y = torch.empty(x.shape[0], raw.shape[0])
    rc = native.library().llmrun_gemm_f32(
        kernels._kernel_type(ggml_type, packed), raw.data_ptr(), raw.stride(0), raw.shape[0],
        x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(), None if bias is None else bias.data_ptr(),
    )  # fmt: skip
    assert rc == 0
    return y


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_avx2_gemm_matches_f32_matmul(ggml_type: T, use_kernels):
    # Tiles of 6 activation rows by 16 weight rows over blocks of 256 columns: rows,
    # weight rows and columns that fill none of them (41, 37, and a last block of 8, 64
    # or 256 columns), every type through its dequantizer, the packed layouts as packed.
    use_kernels("AVX2")
    block = GGML_QUANT_SIZES[ggml_type][0]
    n = 520 if ggml_type in (T.F32, T.F16, T.BF16) else 512 + max(64, block)
    raw = torch.from_numpy(finite_blocks(ggml_type, 37, n, seed=27))
    assert kernels.supports(ggml_type, n)  # (and the i-quants' tables handed over)
    gen = torch.Generator().manual_seed(28)
    x, bias = torch.randn(41, n, generator=gen), torch.randn(37, generator=gen)
    for packed in (False, True) if ggml_type in AVX2_PACKED else (False,):
        w = kernels.pack(raw, ggml_type) if packed else raw
        y = f32_gemm(w, ggml_type, x, packed)
        assert_close_matmul(y, x, reference(raw.numpy(), ggml_type))
        assert torch.equal(f32_gemm(w, ggml_type, x, packed, bias), y + bias)
        assert torch.equal(kernels.matvec(w, ggml_type, x, packed, bias), y + bias)


@pytest.mark.parametrize("m", [33, 200])
def test_avx2_gemm_splits_many_weight_rows_over_the_threads(m: int, use_kernels):
    use_kernels("AVX2")  # 600 rows: blocks of up to 128 rows, taken by the threads in turn
    raw = torch.from_numpy(finite_blocks(T.F16, 600, 64, seed=m))
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
    assert_close_matmul(f32_gemm(raw[::2], T.F16, x, False), x, reference(raw.numpy(), T.F16)[::2])


def test_avx2_prompt_rows_take_the_gemm(use_kernels, monkeypatch):
    use_kernels("AVX2")
    raw = torch.from_numpy(finite_blocks(T.Q4_K, 16, 256, seed=29))
    lin = QuantLinear(raw, T.Q4_K, 256)
    calls = []
    monkeypatch.setattr(kernels, "dequantize", lambda *a, **k: calls.append(a))
    for m in (kernels.F32_GEMM_MIN_ROWS + 1, linear.MATVEC_MAX_ROWS + 1):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        assert_close_matmul(lin(x), x, reference(raw.numpy(), T.Q4_K))
    assert calls == []  # no dequantized tiles for torch's GEMM
