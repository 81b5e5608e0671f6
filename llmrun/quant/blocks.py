"""Dequantize GGML weight blocks with torch ops, bit-exact with `gguf.quants.dequantize`.

Each dequantizer takes uint8 blocks `[n, type_size]` and returns float32
`[n, block_size]`. The float operations and their order mirror the gguf
package's numpy reference, so results match it bit for bit.
Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from gguf import quants as gguf_quants

from llmrun.errors import ModelFormatError, UnsupportedError

T = GGMLQuantizationType
Dequantizer = Callable[[torch.Tensor], torch.Tensor]

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's e2m1 values, doubled (its E8M0 scale is halved to match: 2^(e - 128)).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_DEQUANTIZERS: dict[GGMLQuantizationType, Dequantizer] = {}


def _register(ggml_type: GGMLQuantizationType) -> Callable[[Dequantizer], Dequantizer]:
    def wrap(fn: Dequantizer) -> Dequantizer:
        _DEQUANTIZERS[ggml_type] = fn
        return fn

    return wrap


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 field at byte `start` of each block, as float32 `[n, 1]`."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(*values: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Split `[n, groups*width]` bytes into `[n, groups, 2*width]` nibbles, low nibbles first."""
    n = qs.shape[0]
    shifts = _shifts(0, 4, shape=(1, 1, 2, 1), device=qs.device)
    return ((qs.reshape(n, groups, 1, width) >> shifts) & 0x0F).reshape(n, groups, 2 * width)


def _bits(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """Bit planes of `[n, 32]` bytes: `[n, groups, 32]` where group j holds bit j (j < groups)."""
    n = mask.shape[0]
    shifts = torch.arange(groups, dtype=torch.uint8, device=mask.device).reshape(1, groups, 1)
    return (mask.reshape(n, 1, 32) >> shifts) & 1


def crumbs(qs: torch.Tensor, chunks: int) -> torch.Tensor:
    """2-bit fields of `[n, chunks*32]` bytes: `[n, chunks*4, 32]`, shift 0,2,4,6 per chunk."""
    n = qs.shape[0]
    shifts = _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1), device=qs.device)
    return ((qs.reshape(n, chunks, 1, 32) >> shifts) & 3).reshape(n, chunks * 4, 32)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes of 6-bit scales and mins into two `[n, 8]` uint8 tensors."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


@_register(T.F32)
def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


@_register(T.F16)
def _f16_type(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


@_register(T.BF16)
def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


@_register(T.Q4_0)
def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 2:], 1, 16).reshape(-1, 32)
    return _f16(blocks, 0) * (q.to(torch.int8) - 8).float()


@_register(T.Q4_1)
def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 4:], 1, 16).reshape(-1, 32)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values `[n, 32]`: low nibbles from qs, bit 4 of value j from bit j of the u32 qh."""
    n = qs.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).reshape(1, 1, 8)
    high = ((qh.reshape(n, 4, 1) >> shifts) & 1).reshape(n, 32)
    return nibbles(qs, 1, 16).reshape(n, 32) | (high << 4)


@_register(T.Q5_0)
def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _q5(blocks[:, 2:6], blocks[:, 6:])
    return _f16(blocks, 0) * (q.to(torch.int8) - 16).float()


@_register(T.Q5_1)
def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _q5(blocks[:, 4:8], blocks[:, 8:])
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


@_register(T.Q8_0)
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


@_register(T.Q2_K)
def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    dl = (_f16(blocks, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(blocks, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = crumbs(qs, 2).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


@_register(T.Q3_K)
def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = nibbles(scales[:, :8], 1, 8).reshape(n, 16)
    shifts = _shifts(0, 2, 4, 6, shape=(1, 4, 1), device=blocks.device)
    high = ((scales[:, 8:12].reshape(n, 1, 4) >> shifts) & 3).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 108) * sc).reshape(n, 16, 1)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    offset = (_bits(hmask, 8) ^ 1) << 2
    q = crumbs(qs, 2).to(torch.int8) - offset.to(torch.int8)
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


@_register(T.Q4_K)
def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc, mn = k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).reshape(n, 8, 1)
    q = nibbles(blocks[:, 16:], 4, 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


@_register(T.Q5_K)
def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc, mn = k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.float()).reshape(n, 8, 1)
    q = nibbles(blocks[:, 48:], 4, 32).reshape(n, 8, 32) | (_bits(blocks[:, 16:48], 8) << 4)
    return (d * q.float() - dm).reshape(n, QK_K)


@_register(T.Q6_K)
def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    low = nibbles(ql, 2, 64).reshape(n, 8, 32)
    q = (low | (crumbs(qh, 2) << 4)).to(torch.int8) - 32
    d = (_f16(blocks, 208) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _iq4_lookup(q: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=q.device)
    return table[q.long()]


@_register(T.IQ4_NL)
def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 2:], 1, 16).reshape(-1, 32)
    return _f16(blocks, 0) * _iq4_lookup(q)


@_register(T.IQ4_XS)
def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Scale 2i is the low nibble of byte i, scale 2i+1 its high nibble.
    low = blocks[:, 4:8]
    low = torch.stack([low & 0x0F, low >> 4], dim=2).reshape(n, 8)
    # The u16 at bytes 2..3 holds the two high bits of scale i at bit 2i.
    high = blocks[:, 2:4].to(torch.int32)
    high = high[:, :1] | (high[:, 1:] << 8)
    high = (high >> torch.arange(0, 16, 2, device=blocks.device)) & 3
    sc = ((low.to(torch.int32) | (high << 4)) - 32).float()
    dl = (_f16(blocks, 0) * sc).reshape(n, 8, 1)
    q = nibbles(blocks[:, 8:], 8, 16)
    return (dl * _iq4_lookup(q)).reshape(n, QK_K)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8) -> 2^(e - 128) as float32, built from its bits as gguf
    builds it (e 0 and 1 are subnormal; 255 is 2^127, not NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


@_register(T.MXFP4)
def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # One E8M0 byte, then 16 bytes of e2m1 codes: low nibbles weights 0..15, high 16..31.
    q = nibbles(blocks[:, 1:], 1, 16).reshape(-1, 32)
    table = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    return e8m0_half(blocks[:, :1]) * table[q.long()]


# The i-quants' grids (rows of 8 or 4 weights, indexed by the quants) and the sign table
# ksigns (7 sign bits -> 8, the 8th giving even parity) are gguf's tables, taken from its
# classes: the same data as llama.cpp's ggml-common.h.
@functools.cache
def grid_values(ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`ggml_type`'s grid (an i-quant's; IQ1_M's is IQ1_S's) as float32 `[entries, width]`."""
    reference = getattr(gguf_quants, ggml_type.name)
    reference.init_grid()
    grid = np.array(reference.grid, dtype=np.float32).reshape(reference.grid_shape)
    grid.flags.writeable = False
    return grid


def ksign_bytes() -> bytes:
    """The 128 bytes of the sign table."""
    return gguf_quants.IQ2_XXS.ksigns


@functools.cache
def _grid(ggml_type: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(grid_values(ggml_type).copy()).to(device)


@functools.cache
def _ksigns(device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(ksign_bytes()), dtype=torch.uint8).to(device)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Sign bytes `[...]` -> float32 `[..., 8]`: -1 where bit j of the byte is set, else 1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    values = torch.tensor([1.0, -1.0], device=bits.device)
    return values[((bits.unsqueeze(-1) >> shifts) & 1).long()]


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u16 fields of `[n, 2k]` bytes, as int32 `[n, k]`."""
    b = b.to(torch.int32).reshape(b.shape[0], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u32 fields of `[n, 4k]` bytes, as int64 `[n, k]`."""
    b = b.to(torch.int64).reshape(b.shape[0], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _lookup(ggml_type: GGMLQuantizationType, index: torch.Tensor) -> torch.Tensor:
    """Grid rows for `index` `[n, k]`: float32 `[n, k, width]`."""
    return _grid(ggml_type, index.device)[index.long()]


def _nibble_scales(scales: torch.Tensor) -> torch.Tensor:
    """4-bit scales, low nibble first: `[n, k]` bytes -> int32 `[n, 2k]`."""
    return torch.stack([scales & 0x0F, scales >> 4], dim=2).reshape(scales.shape[0], -1).int()


@_register(T.IQ2_XXS)
def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # 8 sub-blocks of 32: 4 grid indices (bytes), then a u32 of four 7-bit sign indices
    # (bits 0..27) and the 4-bit scale (bits 28..31).
    n = blocks.shape[0]
    groups = blocks[:, 2:].reshape(n, 8, 8)
    aux = _u32(groups[:, :, 4:].reshape(n, 32))  # [n, 8]
    db = (_f16(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    sign_index = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F
    signs = _signs(_ksigns(blocks.device)[sign_index])  # [n, 8, 4, 8]
    grid = _lookup(T.IQ2_XXS, groups[:, :, :4])  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


@_register(T.IQ2_XS)
def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # 32 u16 quants: a 9-bit grid index and a 7-bit sign index; 16 4-bit scales.
    n = blocks.shape[0]
    qs = _u16(blocks[:, 2:66])
    db = (_f16(blocks, 0) * (0.5 + _nibble_scales(blocks[:, 66:74]).float()) * 0.25).reshape(
        n, 16, 1, 1
    )
    signs = _signs(_ksigns(blocks.device)[qs >> 9]).reshape(n, 16, 2, 8)
    grid = _lookup(T.IQ2_XS, qs & 511).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


@_register(T.IQ2_S)
def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # 32 grid indices: low bytes, then 2 high bits each (qh byte j: indices 4j..4j+3);
    # 32 bytes of plain sign bits; 16 4-bit scales.
    n = blocks.shape[0]
    qs, signs, qh = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74]
    db = (_f16(blocks, 0) * (0.5 + _nibble_scales(blocks[:, 74:82]).float()) * 0.25).reshape(
        n, 16, 1, 1
    )
    high = (qh.unsqueeze(-1) >> _shifts(0, 2, 4, 6, shape=(4,), device=qh.device)) & 3
    index = qs.int() | (high.reshape(n, 32).int() << 8)
    grid = _lookup(T.IQ2_S, index).reshape(n, 16, 2, 8)
    return (db * grid * _signs(signs).reshape(n, 16, 2, 8)).reshape(n, QK_K)


@_register(T.IQ3_XXS)
def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # 64 grid indices of 4 weights, then per sub-block of 32 a u32 as IQ2_XXS's.
    n = blocks.shape[0]
    aux = _u32(blocks[:, 66:98])  # [n, 8]
    db = (_f16(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    sign_index = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F
    signs = _signs(_ksigns(blocks.device)[sign_index])  # [n, 8, 4, 8]
    grid = _lookup(T.IQ3_XXS, blocks[:, 2:66]).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


@_register(T.IQ3_S)
def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # 64 grid indices: low bytes, then a high bit each (bit j of qh byte i: index 8i + j);
    # 32 bytes of sign bits; 8 4-bit scales, w = d * (1 + 2 * scale) * grid * sign.
    n = blocks.shape[0]
    qs, qh, signs = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106]
    db = (_f16(blocks, 0) * (1 + 2 * _nibble_scales(blocks[:, 106:110])).float()).reshape(
        n, 8, 1, 1
    )
    high = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=qh.device)) & 1
    index = qs.int() | (high.reshape(n, 64).int() << 8)
    grid = _lookup(T.IQ3_S, index).reshape(n, 8, 4, 8)
    return (db * grid * _signs(signs).reshape(n, 8, 4, 8)).reshape(n, QK_K)


IQ1_DELTA = 0.125


def _deltas(sign: torch.Tensor) -> torch.Tensor:
    """IQ1's offsets to the grid values: float32 -IQ1_DELTA where `sign` is set, else +."""
    delta = torch.tensor([IQ1_DELTA, -IQ1_DELTA], device=sign.device)
    return delta[(sign != 0).long()]


@_register(T.IQ1_S)
def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # 32 grid indices of 8 weights in -1, 0, 1: low bytes, then per sub-block of 32 a u16
    # with 3 high bits for each of its 4 indices, its 3-bit scale and the delta's sign.
    n = blocks.shape[0]
    qh = _u16(blocks[:, 34:50])  # [n, 8]
    dl = (_f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = _deltas(qh & 0x8000).reshape(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=qh.device)) & 7
    index = blocks[:, 2:34].int() | (high.reshape(n, 32) << 8)
    grid = _lookup(T.IQ1_S, index).reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


@_register(T.IQ1_M)
def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # 32 grid indices: low bytes, then a nibble each (3 high bits and the delta's sign);
    # four u16 of 3-bit scales (one per 16 weights) whose top nibbles hold the f16 scale.
    n = blocks.shape[0]
    qs, qh, sc = blocks[:, :32], blocks[:, 32:48], _u16(blocks[:, 48:56])
    bits = (sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=sc.device)
    d_bits = bits[:, 0] | bits[:, 1] | bits[:, 2] | bits[:, 3]
    d_bytes = torch.stack([d_bits & 0xFF, d_bits >> 8], dim=1).to(torch.uint8)
    d = d_bytes.view(torch.float16).float()  # [n, 1]
    scales = (sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=sc.device)) & 7
    dl = (d * (2 * scales.reshape(n, 16) + 1).float()).reshape(n, 8, 2, 1, 1)
    nib = torch.stack([qh & 0x0F, qh >> 4], dim=2).reshape(n, 32)  # index 2j: low nibble of j
    index = qs.int() | ((nib & 7).int() << 8)
    delta = _deltas(nib & 8).reshape(n, 8, 2, 2, 1)
    grid = _lookup(T.IQ1_M, index).reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


@_register(T.TQ1_0)
def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # Base-3 digits packed 5 a byte (4 in the last 4 bytes) as fixed point: digit k of
    # byte q is the top of (q * 3^k mod 256) * 3, over 8 bits. Order: 32 bytes' first
    # digits, their second digits, ..., then the next 16 bytes' likewise, then the last 4.
    n = blocks.shape[0]
    powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=blocks.device)
    parts = [
        (blocks[:, a:b].reshape(n, 1, b - a) * powers[:k].reshape(1, k, 1)).reshape(n, -1)
        for a, b, k in ((0, 32, 5), (32, 48, 5), (48, 52, 4))
    ]
    q = ((torch.cat(parts, dim=1).to(torch.int32) * 3) >> 8) - 1
    return _f16(blocks, 52) * q.float()


@_register(T.TQ2_0)
def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    q = crumbs(blocks[:, :64], 2).reshape(-1, QK_K).to(torch.int8) - 1
    return _f16(blocks, 64) * q.float()


SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)


def check_supported(ggml_type: GGMLQuantizationType) -> None:
    """Raise UnsupportedError unless `ggml_type` has a dequantizer."""
    if ggml_type not in _DEQUANTIZERS:
        name = getattr(ggml_type, "name", str(ggml_type))
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(f"weight type {name} is not supported; supported: {supported}")


def block_size(ggml_type: GGMLQuantizationType) -> int:
    """Number of weights per block of `ggml_type`."""
    check_supported(ggml_type)
    return GGML_QUANT_SIZES[ggml_type][0]


def row_bytes(ggml_type: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights, which must be a whole number of blocks."""
    check_supported(ggml_type)
    size, type_size = GGML_QUANT_SIZES[ggml_type]
    if n_cols <= 0 or n_cols % size:
        raise ModelFormatError(
            f"a row of {n_cols} weights is not a whole number of {ggml_type.name} blocks of {size}"
        )
    return n_cols // size * type_size


def dequantize(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Raw blocks uint8 `[..., row_bytes]` -> weights `[..., row_elems]` in `dtype`."""
    check_supported(ggml_type)
    size, type_size = GGML_QUANT_SIZES[ggml_type]
    if raw.dtype != torch.uint8:
        raise ModelFormatError(f"{ggml_type.name} blocks must be uint8, got {raw.dtype}")
    if raw.dim() == 0 or raw.shape[-1] % type_size:
        raise ModelFormatError(
            f"{ggml_type.name} rows of {raw.shape[-1] if raw.dim() else 0} bytes are not a "
            f"whole number of {type_size}-byte blocks"
        )
    n_blocks = raw.shape[-1] // type_size
    out = _DEQUANTIZERS[ggml_type](raw.reshape(-1, type_size))
    return out.reshape(*raw.shape[:-1], n_blocks * size).to(dtype)
