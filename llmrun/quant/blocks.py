"""Dequantize GGML weight blocks with torch ops, bit-exact with `gguf.quants.dequantize`.

Each dequantizer takes uint8 blocks `[n, type_size]` and returns float32
`[n, block_size]`. The float operations and their order mirror the gguf
package's numpy reference, so results match it bit for bit.
Block layouts: https://github.com/ggml-org/llama.cpp/blob/master/ggml/src/ggml-common.h
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

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
