"""Simple numpy quantizers for Q4_K and Q6_K blocks (the gguf package reads K-quants
but cannot write them).

Round-to-nearest with per-sub-block min/max scales, no search: llama.cpp's own
quantizer picks better scales, but for speed measurements only the layout
matters. Checked against gguf.quants.dequantize by running this file.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows of float32 weights -> Q4_K blocks, uint8 [rows, cols / 256 * 144]."""
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, values]
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0  # per sub-block: w = scale * q - offset, q in 0..15
    offset = -lo
    # Sub-block scales and offsets are 6-bit multiples of two per-block f16 factors.
    d = (scale.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(offset / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = (d[:, None] * sc)[..., None]
    eff_offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint((x + eff_offset) / np.where(eff_scale == 0, 1, eff_scale)), 0, 15).astype(
        np.uint8
    )

    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    # Each 64-value chunk: 32 bytes, low nibbles the first 32 values, high nibbles the next.
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Rows of float32 weights -> Q6_K blocks, uint8 [rows, cols / 256 * 210]."""
    rows, cols = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, sub-blocks, values]
    amax = np.abs(x).max(axis=-1)
    scale = amax / 31.0  # per sub-block: w = scale * q, q in -32..31
    d = (scale.max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    eff = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(x / np.where(eff == 0, 1, eff)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, halves of 128, quarters, 32]
    ql = np.concatenate(
        [
            (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
            (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4),
        ],
        axis=-1,
    ).reshape(-1, 128)
    qh = (
        (q[:, :, 0] >> 4)
        | ((q[:, :, 1] >> 4) << 2)
        | ((q[:, :, 2] >> 4) << 4)
        | ((q[:, :, 3] >> 4) << 6)
    )
    qh = qh.reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=-1)
    return blocks.reshape(rows, -1)


if __name__ == "__main__":
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 512), dtype=np.float32) * 0.02
    for name, fn, bound in [("Q4_K", quantize_q4_k, 0.15), ("Q6_K", quantize_q6_k, 0.04)]:
        qtype = gguf.GGMLQuantizationType[name]
        back = gguf.quants.dequantize(fn(w), qtype)
        err = np.abs(back - w).max() / np.abs(w).max()
        print(f"{name}: max error {err:.4f} of the largest weight")
        assert back.shape == w.shape and err < bound
