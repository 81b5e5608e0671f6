"""GGML types on the native kernels (llmrun.native): which types and row lengths they
take, the packed row layouts some types have a faster kernel for (pack, unpack), and
the calls that multiply (matvec, Matvec) or dequantize (dequantize) blocks.

The kernels know a type by its GGMLQuantizationType value, a packed layout by
PACKED's id (common.h). `supports` is False for every type without native kernels
(llmrun.native.available() False), and callers then use the torch code.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmrun import native
from llmrun.quant import blocks, hugepages

# Types with a faster kernel on a repacked row layout in some kernel family (kernels_avx512.c:
# Q4_0, Q5_0, Q4_K, Q5_K; kernels_avx2.c: Q4_0, Q5_0, Q8_0; `supports` says which this
# family has), by the kernel's type id, and the byte sizes of their block fields in block
# order.
Q4_0, Q5_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
Q4_K, Q5_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K
PACKED = {Q4_0: 1002, Q5_0: 1006, Q8_0: 1008, Q4_K: 1012, Q5_K: 1013}
FIELDS = {
    Q4_0: (2, 16),
    Q5_0: (2, 4, 16),
    Q8_0: (2, 32),
    Q4_K: (2, 2, 12, 128),
    Q5_K: (2, 2, 12, 32, 128),
}
K_SCALE_GROUP = 16  # K-quant blocks whose scale fields `pack` interleaves (C: K_GROUP)
# The i-quants and ternary types, whose kernels (llmrun/native/iquants.h, x86 families)
# read gguf's grids and sign table: `supports` hands them to the library first.
IQ_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in "IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M TQ1_0 TQ2_0".split()
)
# Activation rows past which the 8-bit kernels take tiles of weights (a GEMM) rather
# than passes of up to 8 rows over each run of weights; the K-quants' passes, which sum
# a block in integers, stay ahead longer (Zen 4, 2 threads, 17 rows: Q4_K 9.3 against
# 13.7 ms, Q6_K 9.0 against 14.3; even at 32-48).
GEMM_MIN_ROWS = 16
K_QUANT_GEMM_MIN_ROWS = 32
# Activation rows past which the exact f32 path takes the family's GEMM (gemm_avx2.c),
# where it has one, rather than the matvec's passes (Zen 3, 2 threads, the Qwen2.5-0.5B
# feed-forward shapes: matvec / GEMM time 0.83-1.07 at 16 rows, 0.98-1.28 at 32,
# 1.22-1.62 at 64, 1.5-1.7 at 128).
F32_GEMM_MIN_ROWS = 32


@functools.cache
def supports(ggml_type: GGMLQuantizationType, n_cols: int, packed: bool = False) -> bool:
    """Whether the native kernels take rows of `n_cols` weights of `ggml_type`
    (in the packed layout, if `packed`)."""
    lib = native.library()
    if lib is None or (ggml_type in IQ_TYPES and not _iq_tables(lib)):
        return False
    if packed and ggml_type not in PACKED:
        return False
    block = lib.llmrun_block(_kernel_type(ggml_type, packed))
    return block > 0 and n_cols % block == 0


@functools.cache
def _iq_table_arrays() -> tuple[np.ndarray, ...]:
    """The sign table and the grids in llmrun_iq_tables' order and C types, kept alive
    here for the library's lifetime."""
    T = GGMLQuantizationType
    grids = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]
    return (
        np.frombuffer(blocks.ksign_bytes(), dtype=np.uint8),
        *(np.ascontiguousarray(blocks.grid_values(t), dtype=np.uint8) for t in grids),
        np.ascontiguousarray(blocks.grid_values(T.IQ1_S), dtype=np.int8),
    )


@functools.cache
def _iq_tables(lib) -> bool:
    """Hand `lib` the i-quants' tables; False where its family has no i-quant kernels."""
    if not hasattr(lib, "llmrun_iq_tables"):
        return False
    lib.llmrun_iq_tables(*(table.ctypes.data for table in _iq_table_arrays()))
    return True


@functools.cache
def supports_q8(ggml_type: GGMLQuantizationType, n_cols: int, packed: bool = False) -> bool:
    """Whether the kernels have an 8-bit-activation matvec (llmrun/native/q8.h) for rows
    of `n_cols` weights of `ggml_type` (in the packed layout, if `packed`)."""
    lib = native.library()
    if lib is None or not hasattr(lib, "llmrun_q8_block") or (packed and ggml_type not in PACKED):
        return False
    if ggml_type in IQ_TYPES and not _iq_tables(lib):  # the i-quants' kernels read the grids
        return False
    block = lib.llmrun_q8_block(_kernel_type(ggml_type, packed))
    return block > 0 and n_cols % block == 0


def _kernel_type(ggml_type: GGMLQuantizationType, packed: bool) -> int:
    return PACKED[ggml_type] if packed else int(ggml_type)


def _k_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low quants `[rows, blocks, 128]`, the packed order -> GGML's.

    GGML: byte 32p + l holds weight l of sub-block 2p (low nibble) and of 2p + 1 (high).
    Packed: byte 64h + 4i + s holds weights i (low) and 16 + i (high) of sub-block 4h + s.
    """
    rows, nb = qs.shape[:2]
    b = qs.reshape(rows, nb, 2, 16, 4).transpose(3, 4)  # [.., h, s, i]
    q = torch.stack([b & 15, b >> 4], 4).reshape(rows, nb, 4, 2, 32)  # [.., p, nibble, l]
    return (q[..., 0, :] | q[..., 1, :] << 4).reshape(rows, nb, 128)


def _q5_k_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K high bits `[rows, blocks, 32]`, Q5_K_PACKED's order -> GGML's.

    GGML: bit j of byte l is weight l of sub-block j. Packed: bit b of byte 4j + 2t + h
    (bit 8h + b of u16 mask 2j + t) is weight 16t + 8h + b of sub-block j.
    """
    rows, nb = qh.shape[:2]
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    bits = (qh.reshape(rows, nb, 8, 2, 2)[..., None] >> shifts) & 1  # [.., j, t, h, b]
    bits = bits.permute(0, 1, 3, 4, 5, 2)  # [.., t, h, b, j]
    return (bits << shifts).sum(-1, dtype=torch.uint8).reshape(rows, nb, 32)


def _k_scales(flat: torch.Tensor, nb: int) -> torch.Tensor:
    """K-quant scale fields `[rows, 12 * blocks]` in the packed order -> GGML's `[rows,
    blocks, 12]`. Packed: in groups of K_SCALE_GROUP blocks (the last group holds the c
    blocks left), a group of c blocks holding byte j of its block i at c * j + i."""
    rows = flat.shape[0]
    full = nb - nb % K_SCALE_GROUP  # blocks in whole groups
    groups = flat[:, : 12 * full].reshape(rows, -1, 12, K_SCALE_GROUP).transpose(2, 3)
    tail = flat[:, 12 * full :].reshape(rows, 12, nb - full).transpose(1, 2)
    return torch.cat([groups.reshape(rows, full, 12), tail.reshape(rows, nb - full, 12)], 1)


def pack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """GGML blocks `[rows, row_bytes]` (CPU) -> a new tensor in the packed layout: each
    row stored field by field (all its scales, then ..., then all its quants; same size;
    Q4_K's and Q5_K's scale fields also interleaved by groups of blocks and their
    quants, and Q5_K's high bits, reordered within each block), written by the native
    library (llmrun/native/layout.c)."""
    out = hugepages.empty(raw.shape)  # read whole every token: in huge pages
    raw = raw.contiguous()
    nb = raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1]
    lib = native.library()
    if lib is None or lib.llmrun_pack(
        int(ggml_type), raw.data_ptr(), raw.shape[0], nb, out.data_ptr()
    ):
        raise ValueError(f"no packed layout for {ggml_type.name} here")
    return out


def unpack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The inverse of `pack`, in torch, so packed weights work on any device."""
    rows, nb = raw.shape[0], raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1]
    fields = [f.reshape(rows, nb, -1) for f in raw.split([s * nb for s in FIELDS[ggml_type]], 1)]
    if ggml_type in (Q4_K, Q5_K):
        fields[2] = _k_scales(fields[2].reshape(rows, -1), nb)
        fields[-1] = _k_quants(fields[-1])
    if ggml_type == Q5_K:
        fields[3] = _q5_k_high_bits(fields[3])
    return torch.cat(fields, 2).reshape(rows, -1)


def _n_cols(raw: torch.Tensor, ggml_type: GGMLQuantizationType, packed: bool) -> int:
    """Row length of `raw`, after checking the kernels can take it."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = raw.shape[1] // type_size * block_size
    if raw.device.type != "cpu" or raw.dtype != torch.uint8 or raw.stride(-1) != 1:
        raise ValueError("native kernels need CPU uint8 blocks with contiguous rows")
    if not supports(ggml_type, n, packed):
        raise ValueError(f"no native kernel for {ggml_type.name} rows of {n}")
    return n


def matvec(
    raw: torch.Tensor,
    ggml_type: GGMLQuantizationType,
    x: torch.Tensor,
    packed: bool = False,
    bias: torch.Tensor | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """x f32 `[m, n]` times the blocks `[rows, row_bytes]` transposed (+ f32 `bias`
    `[rows]`) -> f32 `[m, rows]`; with `q8`, x quantized to Q8_0 blocks (K-quants,
    i-quants but IQ4_NL, ternary types: Q8_K) first and the products taken in integers
    (supports_q8)."""
    n = _n_cols(raw, ggml_type, packed)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[1] != n:
        raise ValueError(f"activations must be f32 [m, {n}], got {x.dtype} {list(x.shape)}")
    return Matvec(raw, ggml_type, packed, bias, q8)(x)


class Matvec:
    """A bound `matvec` for one weight tensor (and its bias): its checks and arguments
    worked out once, so a decode step pays only for the call (one per linear layer
    per token). With `q8`, the 8-bit-activation kernel (supports_q8 must hold)."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        packed: bool = False,
        bias: torch.Tensor | None = None,
        q8: bool = False,
    ) -> None:
        self.n = _n_cols(raw, ggml_type, packed)
        if q8 and not supports_q8(ggml_type, self.n, packed):
            raise ValueError(f"no 8-bit-activation kernel for {ggml_type.name} rows of {self.n}")
        self.rows = raw.shape[0]
        if bias is not None and (
            bias.dtype != torch.float32 or bias.device != raw.device or bias.shape != (self.rows,)
            or not bias.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"the bias must be f32 [{self.rows}] on the weight's device")
        self.kept = (raw, bias)  # keeps the memory the pointers below point into alive
        self.args = (_kernel_type(ggml_type, packed), raw.data_ptr(), raw.stride(0), self.rows)
        self.bias = None if bias is None else bias.data_ptr()
        lib = native.library()
        self.q8 = q8
        self.fn = lib.llmrun_matvec_q8 if q8 else lib.llmrun_matvec
        # A prompt's many rows: tiles of weights (q8.h), where the type has them, or the
        # family's f32 GEMM, where it has one (the AVX2 family's); else QuantLinear takes
        # f32 rows past linear.MATVEC_MAX_ROWS to torch's GEMM.
        self.gemm = lib.llmrun_gemm_q8 if q8 else getattr(lib, "llmrun_gemm_f32", None)
        k_quant = ggml_type in (Q4_K, Q5_K, GGMLQuantizationType.Q6_K)
        self.gemm_min_rows = (
            (K_QUANT_GEMM_MIN_ROWS if k_quant else GEMM_MIN_ROWS) if q8 else F32_GEMM_MIN_ROWS
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x f32 `[m, n]` (contiguous) -> f32 `[m, rows]`."""
        m = x.numel() // self.n
        y = torch.empty(m, self.rows, dtype=torch.float32)
        if (
            m > self.gemm_min_rows
            and self.gemm is not None
            and not self.gemm(*self.args, x.data_ptr(), m, self.n, y.data_ptr(), self.bias)
        ):
            return y
        if self.fn(*self.args, x.data_ptr(), m, self.n, y.data_ptr(), self.bias):
            raise MemoryError("no memory for the quantized activations")
        return y


def dequantize(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, packed: bool = False
) -> torch.Tensor:
    """Blocks `[rows, row_bytes]` -> f32 `[rows, n]`, bit-exact with blocks.dequantize."""
    n = _n_cols(raw, ggml_type, packed)
    out = torch.empty(raw.shape[0], n, dtype=torch.float32)
    native.library().llmrun_dequantize(
        _kernel_type(ggml_type, packed),
        raw.data_ptr(),
        raw.stride(0),
        raw.shape[0],
        n,
        out.data_ptr(),
    )
    return out
