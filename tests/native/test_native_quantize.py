"""The native quantizers (llmrun/native/quantize.c) write ggml's reference bytes.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 and BF16 are checked against gguf-py's numpy
`gguf.quants.quantize`. gguf-py has no K-quant quantizer, so for every type the bytes'
sha256 is checked against llama.cpp's: ggml_quantize_chunk (no imatrix, so ggml's
quantize_row_*_ref) of libggml-base.so from the llama-cpp-python 0.3.36 wheel, called
with ctypes on the rows below, once, when this test was written (and again for every
type when the heavy-tailed row became products: Q5_K's digest changed, the others held).
"""

from __future__ import annotations

import hashlib

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from llmrun.errors import UnsupportedError
from llmrun.quantize import quantize_rows

N_COLS = 512


def seeded_rows(seed: int = 0) -> np.ndarray:
    """32 seeded normal rows of 512 weights, the first 12 replaced by edge cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, N_COLS), dtype=np.float32)
    x[0] = 0  # all zero
    x[1] = 0.5  # constant
    x[2, 7] = 1e4  # one huge value
    x[3] *= np.float32(1e-30)  # tiny values (f16 scales underflow)
    x[4] = rng.uniform(0, 1, N_COLS)  # all positive
    x[5] = -rng.uniform(0, 1, N_COLS)  # all negative
    x[6, ::2] = 0  # half zeros
    x[7] = np.round(x[7] * 4) / 4  # on a grid: ties in the rounding
    x[8] *= np.float32(1e-6)
    x[9] = np.float32(-0.0)
    # heavy tails; products, not `** 3`: numpy's float32 power differs in the last bit
    # between CPUs (its AVX-512 code), and the digests below must hold on every CPU
    x[10] = x[10] * x[10] * x[10]
    x[11] = -3.0  # constant negative
    return x


# sha256 of ggml_quantize_chunk(type, seeded_rows(), ...) from llama.cpp (see the docstring)
LLAMA_CPP_DIGESTS = {
    T.F16: "7422790a9584c1b0e0206b761216a51a3f214a39653c1fe9e2063c9c01014f6e",
    T.BF16: "9a7b3513fee04bf7fa3b4ce1e142db9debe2342d96bd7bedb5c0290649a252dc",
    T.Q4_0: "0cad4670c20f3d86b545870bc2eae9d1dc0cc70d510929dbda2ade5fced77671",
    T.Q4_1: "70e13354f5d4848b10d56b48601c6f628b9534e05ea1c3ead6b4c3d8fc5c2c61",
    T.Q5_0: "e597634d984e29e4b0c144981253265f4799c2a1e4106c4de680754c4d2d6423",
    T.Q5_1: "07cce4eb98b85990dbd7a8d2bc6a937f5fb9a9413d4a6903a7aec1405cb17634",
    T.Q8_0: "4adb06d00665819abfa2ac1bb0ce4359a271e05a599cbad13dd95df289fb05ae",
    T.Q2_K: "8cf9f3aba3b3489c47467dc8f450d7e8efbedff78edbe8e83ec921b329f1f96d",
    T.Q3_K: "7a9a1eccfe20dbcde3e1e74a1a779686081f280e12311377a4c501df1dc0a633",
    T.Q4_K: "e39ead7e137bf93a8eb12582da09b6b34e28458bab958114a9b4b45419265638",
    T.Q5_K: "b16d36a35e280ec06cd6061b0ee555742359d297c37a0a8d26c406ec03c0d792",
    T.Q6_K: "4399a66f3c02972a1d0fea9ea4a6859827dc6ae27f5186a90f1a78671c943207",
}


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16])
def test_blocks_equal_gguf_quants(ggml_type: T, native_kernels: str):
    # Not the row of -0.0: there gguf-py's Q4_0 and Q5_0 scale is +0, ggml's -0 (its
    # search for the largest magnitude starts from +0); the digests below cover it.
    rows = np.delete(seeded_rows(1), 9, axis=0)
    expected = gguf.quants.quantize(rows, ggml_type).view(np.uint8).reshape(-1)
    assert np.array_equal(quantize_rows(rows, ggml_type), expected)


@pytest.mark.parametrize("ggml_type", list(LLAMA_CPP_DIGESTS))
def test_blocks_equal_llama_cpp(ggml_type: T, native_kernels: str):
    got = quantize_rows(seeded_rows(), ggml_type, threads=2)
    assert hashlib.sha256(got.tobytes()).hexdigest() == LLAMA_CPP_DIGESTS[ggml_type]


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(UnsupportedError, match="cannot quantize rows of 320 weights to Q4_K"):
        quantize_rows(np.zeros((2, 320), np.float32), T.Q4_K)
