"""The 8-bit-activation matvecs (llmrun/native/q8.h, q8_avx512.c, q8_avx2.c), in both
x86 kernel families, against an independent reference: the activations quantized to
Q8_0 by gguf's numpy code (gguf.quants.quantize), both sides dequantized by gguf,
multiplied in float64. What the kernels compute is exactly that sum of integer
products scaled per block; only the float sums' order differs, so the tolerance is
float rounding: 1e-5 of the largest |output|.
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from test_quant_blocks import F16_FIELDS

from llmrun.quant import kernels
from llmrun.quant.linear import QuantLinear, set_activations

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q5_0, T.Q8_0]


def random_blocks(ggml_type: T, rows: int, cols: int, rng) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        scale = np.abs(rng.standard_normal(len(raw))) * 2e-2 + 1e-4
        raw[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, ggml_type: T, x: np.ndarray, bias=None) -> np.ndarray:
    w = gguf_dequantize(raw, ggml_type).astype(np.float64)
    xq = gguf_dequantize(gguf_quantize(x.astype(np.float32), T.Q8_0), T.Q8_0).astype(np.float64)
    y = xq @ w.T
    return y if bias is None else y + bias


def layout(raw: torch.Tensor, ggml_type: T, cols: int) -> tuple[torch.Tensor, bool]:
    """The blocks in the layout QuantLinear gives them in this kernel family."""
    packed = kernels.supports(ggml_type, cols, packed=True)
    return (kernels.pack(raw, ggml_type) if packed else raw), packed


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("cols", [128, 384, 896])
def test_q8_matvec_is_the_product_of_gguf_quantized_activations(native_kernels, ggml_type, m, cols):
    rng = np.random.default_rng(cols * 10 + m)
    raw_np = random_blocks(ggml_type, 37, cols, rng)
    raw, packed = layout(torch.from_numpy(raw_np), ggml_type, cols)
    assert kernels.supports_q8(ggml_type, cols, packed)
    # a spread of magnitudes per block, a block of zeros, and exact halves that round away
    x = (rng.standard_normal((m, cols)) * rng.choice([0.01, 1.0, 30.0], (m, cols))).astype(
        np.float32
    )
    x[0, :32] = 0.0
    x[-1, 32:64] = np.arange(32) - 15.5
    bias = rng.standard_normal(37).astype(np.float32)
    got = kernels.matvec(
        raw, ggml_type, torch.from_numpy(x), packed, torch.from_numpy(bias), q8=True
    ).numpy()
    expected = reference(raw_np, ggml_type, x, bias)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_types_without_a_q8_kernel_say_so(native_kernels):
    assert not kernels.supports_q8(T.Q6_K, 256)
    assert not kernels.supports_q8(T.F16, 256)
    with pytest.raises(ValueError, match="no 8-bit-activation kernel"):
        kernels.Matvec(torch.zeros(4, 210, dtype=torch.uint8), T.Q6_K, q8=True)


def test_quant_linear_takes_q8_for_decoding_only(native_kernels):
    """set_activations("q8"): a few rows (decode) through the q8 kernel, a prompt's many
    rows through the exact GEMM; "f32" again gives exact products."""
    rng = np.random.default_rng(0)
    raw_np = random_blocks(T.Q4_0, 64, 256, rng)
    layer = QuantLinear(torch.from_numpy(raw_np.copy()), T.Q4_0, 256)
    model = torch.nn.Sequential(layer)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ gguf_dequantize(raw_np, T.Q4_0).astype(np.float64).T
    assert set_activations(model, "q8") == 1
    decode = layer(torch.from_numpy(x[:2])).numpy()
    np.testing.assert_allclose(decode, reference(raw_np, T.Q4_0, x[:2]), rtol=0, atol=1e-4)
    assert np.abs(decode - exact[:2]).max() > 1e-4  # not the exact product
    prefill = layer(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(prefill, exact, rtol=0, atol=1e-4)
    set_activations(model, "f32")
    np.testing.assert_allclose(layer(torch.from_numpy(x[:2])).numpy(), exact[:2], atol=1e-4)
    with pytest.raises(ValueError, match="activations must be one of"):
        set_activations(model, "q4")
