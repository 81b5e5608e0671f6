"""Torch dequantizers against gguf's numpy reference, bit for bit, on random blocks."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.quant.blocks import SUPPORTED_TYPES, dequantize, row_bytes

T = GGMLQuantizationType

# Byte offsets of the f16 fields in each block (ggml-common.h). Random bytes are
# valid blocks except there, where they could be inf or NaN.
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
# IQ1_M's f16 scale is split in four nibbles: the top nibbles of the u16 words at bytes
# 48..55, lowest nibble first.
SPLIT_F16_FIELDS = {T.IQ1_M: 48}
# The types with f16 scales, in their numeric order.
SCALED_TYPES = sorted({*F16_FIELDS, *SPLIT_F16_FIELDS}, key=int)
# Byte offsets of E8M0 scales (a power of two each): random bytes there reach 2^127,
# whose weights overflow to inf, so random blocks take scales near 1.
E8M0_FIELDS = {T.MXFP4: (0,)}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
EXPECTED_TYPES = set(SCALED_TYPES) | set(E8M0_FIELDS) | set(FLOAT_TYPES)


def write_scales(raw: np.ndarray, ggml_type: T, draw) -> None:
    """Put f16 scales `draw(n_blocks)` (floats) into each f16 field of blocks `raw`
    `[n_blocks, type_size]`, in place."""
    for offset in F16_FIELDS.get(ggml_type, ()):
        scales = draw(len(raw)).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type in SPLIT_F16_FIELDS:
        offset = SPLIT_F16_FIELDS[ggml_type]
        words = raw[:, offset : offset + 8].copy().view(np.uint16)  # [n_blocks, 4]
        bits = draw(len(raw)).astype(np.float16).view(np.uint16)[:, None]
        nibbles = (bits >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        raw[:, offset : offset + 8] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)


def random_blocks(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 `[rows, row_bytes]` of random valid blocks of `ggml_type`."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = rows * cols // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    write_scales(raw, ggml_type, lambda n: rng.standard_normal(n) * 2.0 ** rng.integers(-12, 4, n))
    for offset in E8M0_FIELDS.get(ggml_type, ()):
        raw[:, offset] = rng.integers(128 - 16, 128 + 8, n_blocks)
    return raw.reshape(rows, -1)


def every_mxfp4_block() -> np.ndarray:
    """MXFP4 blocks [256, 17] with every scale byte 0..255 (subnormal 2^-128 and 2^-127,
    and 2^127, whose larger weights overflow to inf) and every code in each."""
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    codes = (np.arange(32) + np.arange(256)[:, None]) % 16  # each code twice, shifted by row
    raw[:, 1:] = codes[:, :16] | codes[:, 16:] << 4
    return raw


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit patterns, except that NaNs (from random F16/BF16/F32 bytes) only need to be NaN.

    The CPU's f16 -> f32 conversion quiets signalling NaNs; numpy's keeps them.
    """
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def test_supported_types_are_the_expected_set():
    assert set(SUPPORTED_TYPES) == EXPECTED_TYPES


@pytest.mark.parametrize("ggml_type", sorted(EXPECTED_TYPES, key=lambda t: t.name))
@pytest.mark.parametrize("rows, cols", [(1, 256), (3, 512), (7, 1024)])
def test_dequantize_is_bit_exact_with_gguf(ggml_type: T, rows: int, cols: int):
    raw = random_blocks(ggml_type, rows, cols, seed=rows * cols)
    expected = gguf_dequantize(raw, ggml_type).astype(np.float32)
    got = dequantize(torch.from_numpy(raw), ggml_type)
    assert got.dtype == torch.float32
    assert got.shape == (rows, cols)
    assert_same_bits(got.numpy(), expected)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0, T.IQ4_XS])
def test_dequantize_keeps_leading_dims_and_casts(ggml_type: T):
    raw = random_blocks(ggml_type, 6, 512, seed=3)
    expected = torch.from_numpy(gguf_dequantize(raw, ggml_type).astype(np.float32))
    got = dequantize(torch.from_numpy(raw).reshape(2, 3, -1), ggml_type, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.reshape(2, 3, 512).to(torch.bfloat16))


def test_mxfp4_every_scale_and_code_is_bit_exact_with_gguf():
    raw = every_mxfp4_block()
    with np.errstate(over="ignore"):
        expected = gguf_dequantize(raw, T.MXFP4).astype(np.float32)
    assert np.isinf(expected).any() and (expected[:2] != 0).any()  # the edges are there
    assert_same_bits(dequantize(torch.from_numpy(raw), T.MXFP4).numpy(), expected)
    # +0, never -0, for the code of "minus zero" (8), as gguf gives it
    codes = np.concatenate([raw[:, 1:] & 15, raw[:, 1:] >> 4], axis=1)
    assert not np.signbit(expected[codes == 8]).any()


def test_dequantize_handles_non_contiguous_rows():
    raw = torch.from_numpy(random_blocks(T.Q6_K, 8, 256, seed=5))
    assert torch.equal(dequantize(raw[::2], T.Q6_K), dequantize(raw, T.Q6_K)[::2])


def test_row_bytes():
    assert row_bytes(T.Q4_0, 4096) == 4096 // 32 * 18
    assert row_bytes(T.Q4_K, 4096) == 16 * 144
    assert row_bytes(T.F16, 7) == 14
    with pytest.raises(ModelFormatError, match="Q4_K blocks of 256"):
        row_bytes(T.Q4_K, 4000)


def test_unsupported_type_names_it_and_lists_supported():
    with pytest.raises(UnsupportedError, match="Q8_K.*supported:.*IQ2_XXS.*Q4_K"):
        dequantize(torch.zeros(4, 292, dtype=torch.uint8), T.Q8_K)
    with pytest.raises(UnsupportedError, match="Q8_1"):
        row_bytes(T.Q8_1, 256)


def test_rows_that_are_not_whole_blocks_are_rejected():
    with pytest.raises(ModelFormatError, match="34-byte blocks"):
        dequantize(torch.zeros(2, 35, dtype=torch.uint8), T.Q8_0)
    with pytest.raises(ModelFormatError, match="uint8"):
        dequantize(torch.zeros(2, 34, dtype=torch.int8), T.Q8_0)
