"""Test vectors for the NEON kernels' C driver (driver.c), from gguf's numpy reference.

`write(folder)` writes folder/cases.txt, one case a line (`KIND NAME ARGS...`, read by
driver.c), and the arrays of the case on line I, in the order driver.c reads them, to
I.bin. The checks are those of tests/quant/test_quant_kernels.py and tests/test_ops.py:
weights dequantized bit for bit as gguf dequantizes them; a matvec within
n * 2^-23 * sum|x*w| of the float64 product of those exact weights (only the order of
the f32 sums may differ); the decode ops within test_ops.py's tolerances of a float64
reference, the rotary embedding bit for bit, attention over a KV cache stored as f16,
bf16 or Q8_0 also bit for bit the f32 kernel on the dequantized cache.

Run as a script (`python tests/native/neon/vectors.py FOLDER`) to write them by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
TYPES += [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# The packed layouts' kernel ids (common.h), which the NEON family leaves out.
PACKED = {"Q4_0_PACKED": 1002, "Q5_0_PACKED": 1006, "Q4_K_PACKED": 1012, "Q5_K_PACKED": 1013}
OPS = ["rms_norm", "rms_norm_offset", "rotary", "silu_mul", "gelu_tanh_mul"]
OPS += ["attend_one", "attend_one_capped", "attend_one_stored"]
# What a case's NAME starts with (before any "/"), for a result per type and per op.
GROUPS = [t.name for t in TYPES] + ["packed"] + OPS


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def weights(ggml_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 `[rows, row_bytes]`: random normal weights for the float types, else random
    bytes (any f16 scale, subnormals too; MXFP4's scales 2^-16 to 2^8) with each block
    whose weights are not all finite drawn again."""
    if ggml_type in FLOAT_TYPES:
        w = normal(rng, rows, cols)
        if ggml_type == T.F16:
            return w.astype(np.float16).view(np.uint8)
        if ggml_type == T.BF16:
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if ggml_type == T.MXFP4:  # scales near 1: random E8M0 bytes reach 2^127, and sums overflow
        raw[:, 0] = rng.integers(128 - 16, 128 + 8, raw.shape[0])
    while not (finite := _finite(raw, ggml_type)).all():
        raw[~finite] = rng.integers(0, 256, ((~finite).sum(), size), dtype=np.uint8)
    return raw.reshape(rows, -1)


def _finite(raw: np.ndarray, ggml_type: T) -> np.ndarray:
    """Per block: whether its weights are all finite (an inf or NaN scale makes some not)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.isfinite(dequantize(raw, ggml_type)).all(axis=1)


def f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def f64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float64).tobytes()


def closeness(expected: np.ndarray, rtol: float, atol: float) -> bytes:
    """The expected values and, per value, how far off the result may be (as
    torch.testing.assert_close: atol + rtol * |expected|)."""
    return f64(expected) + f64(atol + rtol * np.abs(expected))


class Cases:
    def __init__(self, folder: Path) -> None:
        self.folder, self.lines = folder, []

    def add(self, kind: str, name: str, args: list, *data: bytes) -> None:
        self.lines.append(" ".join([kind, name, *map(str, args)]))
        if data:
            (self.folder / f"{len(self.lines)}.bin").write_bytes(b"".join(data))


def product(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w.T in float64 and, per value, how far an f32 sum of the same products in any
    order may be from it: n * 2^-23 * sum |x * w| (test_quant_linear.assert_close_matmul)."""
    x = x.astype(np.float64)
    return x @ w.T, x.shape[-1] * 2.0**-23 * (np.abs(x) @ np.abs(w).T) + 1e-30


def add_type(cases: Cases, ggml_type: T, rng: np.random.Generator) -> None:
    name, kernel_type = ggml_type.name, int(ggml_type)
    # Every other row of a tensor: rows `stride` bytes apart, not row_bytes.
    raw = weights(ggml_type, 18, 768, rng)
    expected = dequantize(raw[::2], ggml_type).astype(np.float32)
    cases.add(
        "dequantize", name, [kernel_type, 9, 768, 2 * raw.shape[1]], raw.tobytes(), f32(expected)
    )
    if ggml_type == T.MXFP4:
        # Every scale byte (subnormal 2^-128, 2^-127; 2^127, whose large weights are
        # inf) with every code, in rows of 8 blocks.
        raw = np.zeros((256, 17), dtype=np.uint8)
        raw[:, 0] = np.arange(256)
        codes = (np.arange(32) + np.arange(256)[:, None]) % 16
        raw[:, 1:] = codes[:, :16] | codes[:, 16:] << 4
        raw = raw.reshape(32, -1)
        with np.errstate(over="ignore"):
            expected = dequantize(raw, ggml_type).astype(np.float32)
        args = [kernel_type, 32, 256, raw.shape[1]]
        cases.add("dequantize", f"{name}/every-scale", args, raw.tobytes(), f32(expected))
    shapes = [(m, 512, False) for m in (1, 2, 3, 4, 7, 11, 16)] + [(3, 512, True)]
    if ggml_type in FLOAT_TYPES:  # rows that end in a part of the 32 weights the kernels step by
        shapes += [(2, 48, False), (5, 80, True)]
    for m, n, strided in shapes:  # strided: every other row, and a bias
        raw = weights(ggml_type, 66 if strided else 33, n, rng)
        w = dequantize(raw[::2] if strided else raw, ggml_type).astype(np.float64)
        x = normal(rng, m, n)
        bias = normal(rng, w.shape[0])
        y, bound = product(x, w)
        args = [kernel_type, w.shape[0], n, raw.shape[1] * (1 + strided), m, int(strided)]
        label = f"{name}/m={m},n={n}" + (",strided,bias" if strided else "")
        data = [raw.tobytes(), f32(x), f32(bias) if strided else b""]
        cases.add("matvec", label, args, *data, f64(y + bias * strided), f64(bound))
    # A token's chosen experts in one call (llmrun_matvec_experts): 3 matrices of 17
    # rows, with an x each (x_step n) or one x for all (x_step 0).
    for x_step in (512, 0):
        raw = weights(ggml_type, 3 * 17, 512, rng)
        w = dequantize(raw, ggml_type).astype(np.float64).reshape(3, 17, 512)
        x = normal(rng, 3 if x_step else 1, 512)
        y, bound = zip(*(product(x[j if x_step else 0], w[j]) for j in range(3)), strict=True)
        args = [kernel_type, 17, 512, raw.shape[1], 3, x_step]
        data = [raw.tobytes(), f32(x), f64(np.stack(y)), f64(np.stack(bound))]
        cases.add("experts", f"{name}/experts,x_step={x_step}", args, *data)


def add_ops(cases: Cases, rng: np.random.Generator) -> None:
    """The decode ops' cases (decode_ops.c), each kind named after its C function."""
    for kind, offset, rows, n, w_scale in [
        ("rms_norm", 0.0, 3, 896, 1.0),
        ("rms_norm", 0.0, 2, 100, 1.0),
        ("rms_norm", 0.0, 1, 7, 1.0),
        ("rms_norm_offset", 1.0, 6, 1152, 0.1),  # Gemma's x * (1 + w)
    ]:
        x, w = normal(rng, rows, n, scale=3.0), normal(rng, n, scale=w_scale)
        x64 = x.astype(np.float64)
        y = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * (w + offset)
        data = [f32(x), f32(w), closeness(y, 1e-5, 1e-6)]
        cases.add(kind, f"{kind}/{rows}x{n}", [rows, n, 1e-6, offset], *data)
    for rows, dim, rot in [(14, 64, 64), (3, 80, 80), (4, 96, 32)]:
        x, cos, sin = normal(rng, rows, dim), normal(rng, rot), normal(rng, rot)
        # f32 products and sums, each rounded, as the kernel computes them
        half, y = rot // 2, x.copy()
        y[:, :rot] = x[:, :rot] * cos + np.concatenate([x[:, half:rot], x[:, :half]], 1) * sin
        data = [f32(x), f32(cos), f32(sin), f32(y)]
        cases.add("rotary", f"rotary/{rows}x{dim},{rot}", [rows, dim, rot], *data)
    for kind, n, extremes, rtol, atol in [
        ("silu_mul", 4864, [-200.0, -88.0, -20.0, 0.0, 30.0, 90.0], 1e-6, 1e-30),
        ("gelu_tanh_mul", 6912, [-200.0, -20.0, -6.0, 0.0, 6.0, 90.0], 1e-5, 1e-6),
    ]:
        gate = np.concatenate([normal(rng, n, scale=4.0), np.array(extremes, np.float32)])
        up = normal(rng, gate.size)
        g = gate.astype(np.float64)
        if kind == "silu_mul":
            y = g / (1 + np.exp(-g)) * up
        else:
            y = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * up
        data = [f32(gate), f32(up), closeness(y, rtol, atol)]
        cases.add(kind, f"{kind}/{gate.size}", [gate.size], *data)
    for kind, heads, kv_heads, dim, length, scale, softcap, atol in [
        ("attend_one", 14, 2, 64, 1, 64**-0.5, 0.0, 1e-6),
        ("attend_one", 14, 2, 64, 300, 64**-0.5, 0.0, 1e-6),
        ("attend_one", 4, 1, 80, 257, 80**-0.5, 0.0, 1e-6),
        ("attend_one", 6, 3, 64, 1000, 64**-0.5, 0.0, 1e-6),
        # Gemma: head_dim 256, query_pre_attn_scalar 144, Gemma 2's soft-capping
        ("attend_one_capped", 8, 4, 256, 300, 144**-0.5, 0.0, 2e-5),
        ("attend_one_capped", 8, 4, 256, 1, 144**-0.5, 50.0, 2e-5),
        ("attend_one_capped", 8, 4, 256, 300, 144**-0.5, 50.0, 2e-5),
        ("attend_one_capped", 4, 1, 256, 513, 144**-0.5, 2.0, 2e-5),
    ]:
        capacity = length + 17  # rows of the cache buffer, as the KV cache hands out views of it
        q, k, v = normal(rng, heads, dim), *normal(rng, 2, kv_heads, capacity, dim)
        scale = float(np.float32(scale))  # as the kernel gets it
        group = np.arange(heads) // (heads // kv_heads)
        kh, vh = k[group, :length].astype(np.float64), v[group, :length].astype(np.float64)
        s = np.einsum("hd,hjd->hj", q.astype(np.float64) * scale, kh)
        if softcap:
            s = np.tanh(s / softcap) * softcap
        p = np.exp(s - s.max(-1, keepdims=True))
        y = np.einsum("hj,hjd->hd", p / p.sum(-1, keepdims=True), vh)
        args = [heads, kv_heads, length, dim, capacity * dim, scale, softcap]
        name = f"{kind}/{heads}x{kv_heads}x{dim},{length}" + (
            f",cap={softcap:g}" if softcap else ""
        )
        rtol = 0.0 if kind == "attend_one_capped" else 1e-5  # test_ops.py's for each
        cases.add(kind, name, args, f32(q), f32(k), f32(v), closeness(y, rtol, atol))
    # A KV cache stored as f16, bf16 or Q8_0 (decode_ops.c KV_*: the GGML type ids).
    for ggml_type, heads, kv_heads, dim, length, softcap in [
        (T.F16, 14, 2, 64, 300, 0.0),
        (T.BF16, 4, 1, 128, 257, 0.0),
        (T.Q8_0, 14, 2, 64, 300, 0.0),
        (T.Q8_0, 8, 4, 256, 513, 2.0),
        (T.F16, 8, 4, 256, 1, 50.0),
    ]:
        capacity = length + 17
        q = normal(rng, heads, dim)
        kv = normal(rng, 2, kv_heads, capacity, dim)
        if ggml_type == T.Q8_0:
            raw = quantize(kv.reshape(-1, dim), T.Q8_0)
        elif ggml_type == T.F16:
            raw = kv.astype(np.float16).view(np.uint8)
        else:
            raw = (kv.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        raw = raw.reshape(2, -1)
        values = dequantize(raw.reshape(-1, raw.shape[1] // (kv_heads * capacity)), ggml_type)
        k, v = values.astype(np.float32).reshape(2, kv_heads, capacity, dim)
        scale = float(np.float32(dim**-0.5))
        group = np.arange(heads) // (heads // kv_heads)
        kh, vh = k[group, :length].astype(np.float64), v[group, :length].astype(np.float64)
        s = np.einsum("hd,hjd->hj", q.astype(np.float64) * scale, kh)
        if softcap:
            s = np.tanh(s / softcap) * softcap
        p = np.exp(s - s.max(-1, keepdims=True))
        y = np.einsum("hj,hjd->hd", p / p.sum(-1, keepdims=True), vh)
        head_bytes = raw.shape[1] // kv_heads
        args = [int(ggml_type), heads, kv_heads, length, dim, capacity, head_bytes, scale, softcap]
        name = f"attend_one_stored/{ggml_type.name},{heads}x{kv_heads}x{dim},{length}" + (
            f",cap={softcap:g}" if softcap else ""
        )
        data = [f32(q), raw[0].tobytes(), raw[1].tobytes(), f32(k), f32(v)]
        bound = closeness(y, 1e-5, 2e-5 if softcap else 1e-6)
        cases.add("attend_one_stored", name, args, *data, bound)


def write(folder: Path) -> list[str]:
    """The test vectors into `folder`; the cases' names."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    cases = Cases(folder)
    for ggml_type in TYPES:
        add_type(cases, ggml_type, rng)
    for name, kernel_type in PACKED.items():
        cases.add("unsupported", f"packed/{name}", [kernel_type])
    add_ops(cases, rng)
    (folder / "cases.txt").write_text("\n".join(cases.lines) + "\n")
    return [line.split()[1] for line in cases.lines]


if __name__ == "__main__":
    print(f"{len(write(Path(sys.argv[1])))} cases in {sys.argv[1]}")
