"""f32 rows as i-quant (IQ1_S .. IQ4_XS) or ternary (TQ1_0, TQ2_0) blocks, byte-identical
to ggml's ggml_quantize_chunk, through the native library's quantizers
(llmrun/native/quantize_iq.c), with or without an importance row.

The lattice types' grids are gguf's decoding grids (llmrun.quant.blocks.grid_values), turned
here into ggml's kgrid tables (each point's coordinates as the ranks of its values, 2 bits
each for the 8-wide grids, 3 for the 4-wide) and handed to the library once.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmrun import native
from llmrun.errors import UnsupportedError, UsageError
from llmrun.quant import blocks

T = GGMLQuantizationType
TYPES = frozenset(
    {T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS}
    | {T.TQ1_0, T.TQ2_0}
)
# ggml_quantize_requires_imatrix: ggml's quantizers of these have no unweighted search.
NEEDS_IMATRIX = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ1_S})
# The lattices in llmrun_quantize_iq_grids' order, with the bits of a coordinate's rank.
_LATTICES = (
    (T.IQ2_XXS, 2),
    (T.IQ2_XS, 2),
    (T.IQ2_S, 2),
    (T.IQ1_S, 2),
    (T.IQ3_XXS, 3),
    (T.IQ3_S, 3),
)


def kgrid(ggml_type: GGMLQuantizationType, bits: int) -> np.ndarray:
    """ggml's kgrid table of an i-quant: per grid point, the rank of each coordinate's value
    among the grid's values, `bits` bits each, first coordinate lowest."""
    grid = blocks.grid_values(ggml_type)
    ranks = np.searchsorted(np.unique(grid), grid).astype(np.int64)
    return (ranks << (bits * np.arange(grid.shape[1]))).sum(axis=1).astype(np.uint16)


@functools.cache
def _grids() -> tuple[np.ndarray, ...]:
    """The kgrid tables, handed to the library and kept alive here for its lifetime."""
    tables = tuple(np.ascontiguousarray(kgrid(t, bits)) for t, bits in _LATTICES)
    native.library().llmrun_quantize_iq_grids(*(table.ctypes.data for table in tables))
    return tables


def quantize_rows(
    weights: np.ndarray,
    ggml_type: GGMLQuantizationType,
    threads: int = 1,
    imatrix: np.ndarray | None = None,
) -> np.ndarray:
    """f32 rows `[rows, n]` as `ggml_type`'s bytes (a type of TYPES); `imatrix`: the n
    importances of the columns, which the types of NEEDS_IMATRIX must have."""
    lib = native.library()
    if lib is None:
        raise UnsupportedError(f"quantizing needs the native library ({native.status()})")
    if imatrix is None and ggml_type in NEEDS_IMATRIX:
        raise UsageError(f"quantizing to {ggml_type.name} needs an importance matrix")
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    rows, n_cols = weights.shape
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_cols,):
            raise UsageError(
                f"an importance row of {imatrix.size} values does not fit rows of {n_cols}"
            )
    _grids()
    size, type_size = GGML_QUANT_SIZES[ggml_type]
    out = np.empty(rows * (n_cols // size) * type_size, dtype=np.uint8)
    written = lib.llmrun_quantize_iq(
        int(ggml_type),
        weights.ctypes.data,
        out.ctypes.data,
        rows,
        n_cols,
        None if imatrix is None else imatrix.ctypes.data,
        threads,
    )
    if written != out.nbytes:
        raise UnsupportedError(f"cannot quantize rows of {n_cols} weights to {ggml_type.name}")
    return out
