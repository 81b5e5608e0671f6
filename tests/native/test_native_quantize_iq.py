"""The native i-quant and ternary quantizers (llmrun/native/quantize_iq.c) write ggml's bytes.

gguf-py has no quantizer for these types, so the bytes' sha256 is checked against
llama.cpp's: ggml_quantize_chunk of libggml-base.so from the llama-cpp-python 0.3.36 wheel,
called with ctypes on test_native_quantize's seeded rows (32 rows of 512 weights, 12 of
them edge cases: zeros, constants, a huge value, tiny values, one sign only, ...), with no
importance row and with the seeded one below, once, when this test was written.
"""

from __future__ import annotations

import hashlib

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_native_quantize import N_COLS, seeded_rows

from llmrun.errors import UsageError
from llmrun.quant import quantize_iq
from llmrun.quantize import quantize_rows

# sha256 of ggml_quantize_chunk(type, seeded_rows(), ...): (no imatrix, IMATRIX); ggml
# refuses IQ1_S, IQ2_XS and IQ2_XXS without one. TQ1_0 and TQ2_0 ignore it.
LLAMA_CPP_DIGESTS = {
    T.IQ1_M: (
        "52fed8d84b23e5661d31f9f22f4cde53bac923a32830e433e95170f41756dfa1",
        "bd9c6b7cc0a02b980ddd708c8c59c1908f2d9d1c5964b4a36a347ce5d782f6bb",
    ),
    T.IQ1_S: (None, "922a320581b67bec1e1ce88fad88f5d9ac97cfc6f7cc6b32066b1916b80d63d9"),
    T.IQ2_S: (
        "7dbff8be374b75681cd7cf425549732a62da5e94cd7aaebe95639737a88a8e54",
        "4def9e2890c95e2e4cddfd03d1e1940b020ff8d3cdb9d5994ed04d3fef6838f7",
    ),
    T.IQ2_XS: (None, "c19383ec8e95d26e726600fefa46f1decfdb97aba0c35a06e8d1476704b8a226"),
    T.IQ2_XXS: (None, "472a9cce820c0e85c155dd623e84e65ade537c918b5d639099818ababb3512a8"),
    T.IQ3_S: (
        "ab227b33b950ea902ae857a6af077221dae584151342f44069fded238845dddd",
        "92c53dc7c6b9ff76f0dd2945e53bc9ba336d41e7e59bf9d8c774e453c03bed72",
    ),
    T.IQ3_XXS: (
        "22e65244e7ccf1f05ccee9e4d7fbfaeede176e6d65eb27b262e782d0b7022bad",
        "0ada248e2590281674d560632ed2d6eac72b85e94bdf6750082792c312aefc7d",
    ),
    T.IQ4_NL: (
        "9ee5e7ab1d5363543c0d3ec20331245a42a92484f5b270414215c43c43281566",
        "4c511e97e65bbceadf05e3a37d4b2d8d986203778f175793be456e5f58b48422",
    ),
    T.IQ4_XS: (
        "5c9b12453e030f81bdfbcb2b8a5df3de119277c6af457583e55499bd69048bac",
        "d3c4853e67a8d06a2d9e2ce6a016d310319a2c6d87b2367199e1845a3430b16f",
    ),
    T.TQ1_0: ("ee87c1e2bf1de268388021151bc4982bad3288a202675418b6ad4dd4f5e1a97a",) * 2,
    T.TQ2_0: ("f78c204e2c0ebf725ec9c178f0b3ac64f4556267cce3c670f19f93cb1b344ad8",) * 2,
}
IMATRIX = np.random.default_rng(1).uniform(0.1, 4.0, N_COLS).astype(np.float32)
CASES = [
    (t, with_imatrix)
    for t in LLAMA_CPP_DIGESTS
    for with_imatrix in (False, True)
    if LLAMA_CPP_DIGESTS[t][with_imatrix]
]


@pytest.mark.parametrize("ggml_type, with_imatrix", CASES, ids=lambda v: getattr(v, "name", v))
def test_bytes_equal_llama_cpps(ggml_type: T, with_imatrix: bool):
    out = quantize_rows(seeded_rows(), ggml_type, 2, IMATRIX if with_imatrix else None)
    assert hashlib.sha256(out.tobytes()).hexdigest() == LLAMA_CPP_DIGESTS[ggml_type][with_imatrix]


# The relative RMS error of each type on normal rows, as gguf's dequantizer reads its blocks
# back (llama.cpp's quantizer gives 0.08, 0.14 and 0.20 for IQ4_XS, IQ3_S and IQ3_XXS, 0.26
# to 0.36 for the IQ2 types, 0.48 and 0.51 for IQ1_M and IQ1_S, 0.80 for the ternary types,
# which are meant for ternary weights).
DECODED_ERROR = {T.IQ4_NL: 0.1, T.IQ4_XS: 0.1, T.IQ3_S: 0.17, T.IQ3_XXS: 0.22}
DECODED_ERROR |= {T.IQ2_S: 0.3, T.IQ2_XS: 0.35, T.IQ2_XXS: 0.4, T.IQ1_M: 0.55, T.IQ1_S: 0.55}
DECODED_ERROR |= {T.TQ1_0: 0.85, T.TQ2_0: 0.85}


@pytest.mark.parametrize("ggml_type", list(DECODED_ERROR), ids=lambda t: t.name)
def test_blocks_decode_near_the_weights(ggml_type: T):
    rows = seeded_rows()[12:]
    out = quantize_rows(rows, ggml_type, 1, IMATRIX).reshape(len(rows), -1)
    error = np.sqrt(((gguf.quants.dequantize(out, ggml_type) - rows) ** 2).mean())
    assert error < DECODED_ERROR[ggml_type] * np.sqrt((rows**2).mean())


def test_kgrids_are_ggmls_tables():
    # ggml's kgrid_2bit_256 and kgrid_256 begin so (ggml-quants.c, iq2xs/iq3xs_init_impl)
    assert quantize_iq.kgrid(T.IQ2_XXS, 2)[:8].tolist() == [0, 2, 5, 8, 10, 17, 20, 32]
    assert quantize_iq.kgrid(T.IQ3_XXS, 3)[:4].tolist() == [0, 2, 4, 9]


def test_types_without_their_importance_row_are_refused():
    with pytest.raises(UsageError, match="quantizing to IQ2_XXS needs an importance matrix"):
        quantize_rows(seeded_rows(), T.IQ2_XXS)
    with pytest.raises(UsageError, match="an importance row of 3 values does not fit rows of 512"):
        quantize_rows(seeded_rows(), T.IQ4_XS, imatrix=np.ones(3, np.float32))
