"""The 8-bit-activation matvecs (llmrun/native/q8.h, q8_avx512.c, q8_avx2.c), in both
x86 kernel families, for every type and layout they take (GGML's, as experts keep it,
and the packed layouts QuantLinear repacks into), against an independent reference:
the activations quantized as llama.cpp quantizes them for the type (its vec_dot_type):
to Q8_0 by gguf's numpy code (gguf.quants.quantize; Q4_0, Q5_0, Q8_0, MXFP4, IQ4_NL),
and for the K-quants, the other i-quants and the ternary types to Q8_K by
q8_k_dequantized below (ggml's quantize_row_q8_K_ref, written from its definition), the
weights dequantized by gguf, multiplied in float64. What the kernels compute is exactly
that sum of integer products scaled per block (K-quants and i-quants: per sub-block,
the K-quants less the mins' part); only the float sums' order differs, so the tolerance
is float rounding: 1e-5 of the largest |output| (one activation quant off by one step
would be about 5e-4 of it). A prompt's 37 rows take the tiles of llmrun_gemm_q8 (both
families), the experts and a few rows the passes of the matvec.
"""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from test_quant_blocks import E8M0_FIELDS, F16_FIELDS, SPLIT_F16_FIELDS, write_scales

from llmrun import native
from llmrun.native import build
from llmrun.quant import kernels
from llmrun.quant.linear import QuantLinear, set_activations

T = GGMLQuantizationType
# The i-quants and ternary types whose activations llama.cpp quantizes to Q8_K.
IQ_Q8_K = [
    T[name] for name in "IQ4_XS IQ3_S IQ3_XXS IQ2_XXS IQ2_XS IQ2_S IQ1_S IQ1_M TQ1_0 TQ2_0".split()
]
TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, *IQ_Q8_K]
# Row lengths: K-quants take multiples of 256 (4352: a packed row's whole group of 16
# blocks' scales and one more), the others of 32 (96 and 2880, gpt-oss's: a last four
# blocks of fewer).
COLS = {t: [256, 768, 4352] for t in (T.Q4_K, T.Q5_K, T.Q6_K, *IQ_Q8_K)}
CASES = [(t, cols) for t in TYPES for cols in COLS.get(t, [96, 128, 384, 2880])]
# ... in GGML's layout, and packed where some family packs the type
CASES = [(t, cols, False) for t, cols in CASES] + [
    (t, cols, True) for t, cols in CASES if t in kernels.PACKED
]
# The packed layouts (kernels.pack) with 8-bit-activation kernels, by kernel family, and
# the row lengths those take multiples of (AVX-512's packed K-quants: with VBMI).
VBMI = "avx512vbmi" in build.cpu_features().split()
PACKED_Q8 = {
    "AVX-512": {T.Q4_0: 128, T.Q5_0: 128} | ({T.Q4_K: 256, T.Q5_K: 256} if VBMI else {}),
    "AVX2": {T.Q4_0: 128, T.Q5_0: 128, T.Q8_0: 32},
}


def random_blocks(ggml_type: T, rows: int, cols: int, rng) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    write_scales(raw, ggml_type, lambda n: np.abs(rng.standard_normal(n)) * 2e-2 + 1e-4)
    for offset in E8M0_FIELDS.get(ggml_type, ()):
        raw[:, offset] = rng.integers(120, 128, len(raw))  # 2^-8 .. 2^-1
    return raw.reshape(rows, -1)


# The types whose activations llama.cpp quantizes to Q8_K (its vec_dot_type), not Q8_0.
Q8_K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, *IQ_Q8_K)


def activations(m: int, cols: int, rng) -> np.ndarray:
    """A spread of magnitudes per block, a block of zeros, and exact halves that round
    away from zero (Q8_0); for rows of 512 or more, a block of 256 whose largest
    magnitude comes first negative, then positive, and one whose largest value is 127,
    so that its other values scale to exact halves that round to even (Q8_K)."""
    x = rng.standard_normal((m, cols)) * rng.choice([0.01, 1.0, 30.0], (m, cols))
    x = x.astype(np.float32)
    x[0, :32] = 0.0
    x[-1, 32:64] = np.arange(32) - 15.5
    if cols >= 512:
        x[0, 300], x[0, 400] = -1000.0, 1000.0
        x[-1, 256:512] = np.concatenate([[127.0], np.arange(255) * 0.5 - 60.0])
    return x


def q8_k_dequantized(x: np.ndarray) -> np.ndarray:
    """x [m, n] quantized to Q8_K and back, in float64: per 256 values, max the first
    value of largest magnitude, iscale = -127 / max and q = min(127, x * iscale rounded
    half to even) in f32, d = 1 / iscale (all zero where the block is)."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    out = np.zeros(blocks.shape)
    for i, block in enumerate(blocks):
        largest = block[np.argmax(np.abs(block))]
        if largest == 0:
            continue
        iscale = np.float32(-127.0) / largest
        q = np.minimum(np.rint(iscale * block), 127)
        out[i] = np.float64(np.float32(1.0) / iscale) * q
    return out.reshape(x.shape)


def quantized_activations(x: np.ndarray, ggml_type: T) -> np.ndarray:
    """x as the 8-bit-activation kernels of `ggml_type` take it, in float64: Q8_K for
    Q8_K_TYPES, else Q8_0 (as llama.cpp's vec_dot_type)."""
    if ggml_type in Q8_K_TYPES:
        return q8_k_dequantized(x)
    return gguf_dequantize(gguf_quantize(x.astype(np.float32), T.Q8_0), T.Q8_0).astype(np.float64)


def reference(raw: np.ndarray, ggml_type: T, x: np.ndarray, bias=None) -> np.ndarray:
    w = gguf_dequantize(raw, ggml_type).astype(np.float64)
    y = quantized_activations(x, ggml_type) @ w.T
    return y if bias is None else y + bias


def assert_near(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize(
    "ggml_type,cols,packed",
    CASES,
    ids=lambda c: {True: "packed", False: "ggml"}.get(c, getattr(c, "name", c)),
)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11, 37])
def test_q8_matvec_is_the_product_of_reference_quantized_activations(
    native_kernels, ggml_type, cols, packed, m
):
    if packed and not kernels.supports(ggml_type, cols, packed=True):
        # the family has no packed layout for these rows (QuantLinear keeps GGML's): no
        # 8-bit kernel may claim one
        assert not kernels.supports_q8(ggml_type, cols, packed=True)
        return
    if packed:
        multiple = PACKED_Q8[native_kernels].get(ggml_type)
        has_q8 = multiple is not None and cols % multiple == 0
        assert kernels.supports_q8(ggml_type, cols, packed) == has_q8
        if not has_q8:
            return
    assert kernels.supports_q8(ggml_type, cols)
    rng = np.random.default_rng(cols * 10 + m)
    raw_np = random_blocks(ggml_type, 37, cols, rng)
    raw = torch.from_numpy(raw_np)
    x = activations(m, cols, rng)
    bias = rng.standard_normal(37).astype(np.float32)
    got = kernels.matvec(
        kernels.pack(raw, ggml_type) if packed else raw,
        ggml_type,
        torch.from_numpy(x),
        packed,
        torch.from_numpy(bias),
        q8=True,
    )
    assert_near(got.numpy(), reference(raw_np, ggml_type, x, bias))


def test_types_without_a_q8_kernel_say_so(native_kernels):
    assert not kernels.supports_q8(T.Q2_K, 256)
    assert not kernels.supports_q8(T.F16, 256)
    assert not kernels.supports_q8(T.Q4_K, 128)  # not a whole block
    with pytest.raises(ValueError, match="no 8-bit-activation kernel"):
        kernels.Matvec(torch.zeros(4, 84, dtype=torch.uint8), T.Q2_K, q8=True)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_q8_experts_take_each_matrix_with_its_activations(native_kernels, ggml_type):
    """llmrun_matvec_experts_q8: a token's chosen experts in one call, the activations
    quantized once (x_step 0) or a row per expert (x_step n, or any wider step)."""
    rows, cols = 40, COLS.get(ggml_type, [288])[0]  # 288: nine blocks of 32
    rng = np.random.default_rng(5)
    raw = random_blocks(ggml_type, 6 * rows, cols, rng).reshape(6, rows, -1)
    stacked = torch.from_numpy(raw)
    chosen = [4, 0, 5]
    addresses = torch.tensor([stacked[e].data_ptr() for e in chosen], dtype=torch.int64)
    fn = native.library().llmrun_matvec_experts_q8
    # The i-quants' kernels read grid tables that supports_q8 hands the library first; a
    # test of its own must not rely on another having done it in this process.
    assert kernels.supports_q8(ggml_type, cols)

    def call(x: np.ndarray, x_step: int) -> np.ndarray:
        y = torch.empty(len(chosen), rows)
        assert fn(int(ggml_type), addresses.data_ptr(), stacked.stride(1), rows,
                  torch.from_numpy(x).data_ptr(), x_step, cols, y.data_ptr(), len(chosen)) == 0  # fmt: skip
        return y.numpy()

    x = activations(1, cols, rng)
    got = call(x, 0)
    for j, e in enumerate(chosen):
        assert_near(got[j], reference(raw[e], ggml_type, x)[0])
    xs = activations(3, cols, rng)
    wide = np.concatenate([xs, np.full((3, 32), np.nan, np.float32)], 1)  # never read
    for x_rows, step in ((xs, cols), (wide, cols + 32)):
        got = call(np.ascontiguousarray(x_rows), step)
        for j, e in enumerate(chosen):
            assert_near(got[j], reference(raw[e], ggml_type, xs[j : j + 1])[0])
    # No kernel for the type, or for rows of that length: -1, as llmrun_matvec_experts.
    y = torch.empty(len(chosen), rows)
    assert fn(int(T.Q2_K), addresses.data_ptr(), 84, rows, torch.from_numpy(x).data_ptr(), 0,
              256, y.data_ptr(), 3) == -1  # fmt: skip
    assert fn(int(ggml_type), addresses.data_ptr(), stacked.stride(1), rows,
              torch.from_numpy(x).data_ptr(), 0, cols - 16, y.data_ptr(), 3) == -1  # fmt: skip


def test_quant_linear_takes_q8_for_every_product(native_kernels):
    """set_activations("q8"): a few rows (decode) and a prompt's many rows (in passes of
    up to 8 over each run of weights) through the q8 kernel; "f32" gives exact products
    again (a prompt's through the f32 GEMM)."""
    rng = np.random.default_rng(0)
    raw_np = random_blocks(T.Q4_0, 64, 256, rng)
    layer = QuantLinear(torch.from_numpy(raw_np.copy()), T.Q4_0, 256)
    model = torch.nn.Sequential(layer)
    x = rng.standard_normal((43, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ gguf_dequantize(raw_np, T.Q4_0).astype(np.float64).T
    assert set_activations(model, "q8") == 1
    decode = layer(torch.from_numpy(x[:2])).numpy()
    assert_near(decode, reference(raw_np, T.Q4_0, x[:2]))
    assert np.abs(decode - exact[:2]).max() > 1e-4  # not the exact product
    prompt = layer(torch.from_numpy(x).view(1, 43, 256)).numpy()
    assert prompt.shape == (1, 43, 64)
    assert_near(prompt[0], reference(raw_np, T.Q4_0, x))
    set_activations(model, "f32")
    np.testing.assert_allclose(layer(torch.from_numpy(x[:2])).numpy(), exact[:2], atol=1e-4)
    np.testing.assert_allclose(layer(torch.from_numpy(x)).numpy(), exact, atol=1e-4)
    with pytest.raises(ValueError, match="activations must be one of"):
        set_activations(model, "q4")


GEMM_TYPES = [
    (T.Q4_0, True), (T.Q5_0, True), (T.Q8_0, True), (T.Q4_0, False), (T.Q5_0, False),
    (T.Q8_0, False), (T.MXFP4, False), (T.Q4_K, False), (T.Q5_K, False), (T.Q6_K, False),
    (T.Q4_K, True), (T.Q5_K, True), (T.IQ4_NL, False), *((t, False) for t in IQ_Q8_K),
]  # fmt: skip


@pytest.mark.parametrize("ggml_type,packed", GEMM_TYPES, ids=lambda c: getattr(c, "name", c))
def test_a_prompt_takes_the_tiles_where_the_family_has_them(native_kernels, ggml_type, packed):
    """llmrun_gemm_q8 itself (what kernels.Matvec tries first for a prompt): both
    families take every type above (AVX2's Q8_0, AVX-512's Q4_K and Q5_K also in their
    packed layouts), rows of 40
    activations into 45 weight rows (a partial last tile of 16 or 32), bias and all,
    with weights at the extremes of each type's range (where 16-bit pair sums, AVX2's
    and AVX-512's without VNNI, would saturate first)."""
    if packed and ggml_type not in PACKED_Q8[native_kernels]:
        pytest.skip(f"{native_kernels} does not pack {ggml_type.name}")
    check_tiles(ggml_type, packed)


def test_avx512_without_vnni_takes_the_tiles(use_kernels, monkeypatch):
    """The AVX-512 family built without VNNI (Skylake-X's), on a CPU that has it: its
    tiles sum vpmaddubsw's 16-bit pairs in groups instead of vpdpbusd (CPUs without
    VNNI run this through the test above)."""
    features = build.cpu_features().split()
    if not {"avx512bw", "avx512_vnni"} <= set(features):
        pytest.skip("needs an AVX-512 CPU with VNNI (without it, the test above covers this)")
    family = build.FAMILIES["AVX-512"]
    without = dataclasses.replace(family, march=(*family.march, "-mno-avx512vnni"))
    monkeypatch.setitem(build.FAMILIES, "AVX-512", without)
    use_kernels("AVX-512")  # built again, with those flags
    for ggml_type, packed in GEMM_TYPES:
        if not packed or ggml_type in PACKED_Q8["AVX-512"]:
            check_tiles(ggml_type, packed)


def test_avx512_without_vnni_takes_the_iquants(use_kernels, monkeypatch):
    """The same build's matvecs of the i-quants and ternary types, whose pair sums widen
    in vpmaddwd (and meet the scales in vpmaddwd and an add) instead of vpdpbusd and
    vpdpwssd."""
    if not {"avx512bw", "avx512_vnni"} <= set(build.cpu_features().split()):
        pytest.skip("needs an AVX-512 CPU with VNNI (without it, the tests above cover this)")
    family = build.FAMILIES["AVX-512"]
    without = dataclasses.replace(family, march=(*family.march, "-mno-avx512vnni"))
    monkeypatch.setitem(build.FAMILIES, "AVX-512", without)
    use_kernels("AVX-512")
    rng = np.random.default_rng(3)
    for ggml_type in [T.IQ4_NL, *IQ_Q8_K]:
        cols = COLS.get(ggml_type, [96])[0]
        raw = random_blocks(ggml_type, 20, cols, rng)
        x = activations(3, cols, rng)
        got = kernels.matvec(torch.from_numpy(raw), ggml_type, torch.from_numpy(x), q8=True)
        assert_near(got.numpy(), reference(raw, ggml_type, x))


def check_tiles(ggml_type: T, packed: bool) -> None:
    lib = native.library()
    assert kernels.supports(ggml_type, 256)  # the i-quants' tables handed over first
    cols = 256 if ggml_type in (T.Q4_0, T.Q5_0) and packed else COLS.get(ggml_type, [96])[0]
    cols = 512 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else cols
    rng = np.random.default_rng(9)
    raw_np = random_blocks(ggml_type, 45, cols, rng)
    extreme = random_blocks(ggml_type, 45, cols, rng)
    scales = {o + k for o in F16_FIELDS.get(ggml_type, ()) for k in (0, 1)}
    scales |= set(E8M0_FIELDS.get(ggml_type, ()))
    if ggml_type in SPLIT_F16_FIELDS:  # IQ1_M's scale words, which hold its d too
        scales |= set(range(SPLIT_F16_FIELDS[ggml_type], SPLIT_F16_FIELDS[ggml_type] + 8))
    quants = [i for i in range(raw_np.shape[1]) if i % GGML_QUANT_SIZES[ggml_type][1] not in scales]
    # the largest u8 each type's quants take (MXFP4: 12 + 12), or Q8_0's -128, or the
    # IQ4 codebook's -127 (IQ4_XS: with its sub-block scales' -32)
    largest = {T.Q8_0: 0x80, T.MXFP4: 0x77, T.IQ4_NL: 0, T.IQ4_XS: 0}
    extreme[:, quants] = largest.get(ggml_type, 0xFF)
    raw_np[:5] = extreme[:5]
    raw = torch.from_numpy(raw_np)
    w = kernels.pack(raw, ggml_type) if packed else raw
    kind = kernels.PACKED[ggml_type] if packed else int(ggml_type)
    x = activations(40, cols, rng)
    x[:4] = np.float32([[0.5], [1.0], [3.0], [1e-3]])  # x's quants all 127 ...
    x[4:8] = -x[:4]  # ... and -127
    bias = rng.standard_normal(45).astype(np.float32)
    y = np.zeros((40, 45), np.float32)
    assert lib.llmrun_gemm_q8(kind, w.data_ptr(), w.stride(0), 45, x.ctypes.data, 40, cols,
                              y.ctypes.data, bias.ctypes.data) == 0  # fmt: skip
    assert_near(y, reference(raw_np, ggml_type, x, bias))
