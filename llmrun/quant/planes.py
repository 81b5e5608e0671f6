"""Quantized weights in a GPU layout: each GGML block's fields split into planes.

A GGML row interleaves each block's f16 scales with its quants (Q4_0: 2 bytes of
scale, 16 of nibbles, 18 a block), so reading a scale as f16 takes a copy of the
bytes first, and a GPU's neighbouring threads load from unaligned, strided
addresses. On CUDA and MPS a weight of a type here is split once, when the model is
loaded, into one contiguous tensor per field ([rows, blocks] f16 scales, [rows,
blocks, bytes] quants, Q4_K's 6-bit scales and mins unpacked to bytes): the same
bits in about the same memory (Q4_K: 148 bytes a block of 256 weights, for 144), read
with aligned loads and dequantized with no copy.

`dequantize` gives exactly gguf's values (tests/quant/test_planes.py). `matvec` is
the product for a few rows of activations as elementwise products and sums, which
torch.compile fuses with the dequantization into one kernel per matrix that reads
each quantized weight once (on CUDA, PlanarLinear compiles it); run eagerly it
would make the [rows, out, in] products, so elsewhere PlanarLinear dequantizes
tiles and multiplies them with F.linear, as prefill does everywhere. A weight of any
other type (the i-quants and the ternary types among them) stays a QuantLinear, whose
torch code dequantizes its blocks on every forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from torch import nn

from llmrun.quant import kernels
from llmrun.quant.blocks import crumbs, k_scales, nibbles
from llmrun.quant.linear import QuantLinear

T = GGMLQuantizationType
Planes = dict[str, torch.Tensor]

# Rows of activations up to which the fused product runs (a decode step's batch).
FUSED_MAX_ROWS = 8
# Weights dequantized per tile for F.linear, as QuantLinear does.
TILE_WEIGHTS = 1 << 24


def _f16(fields: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block of [rows, blocks, block_bytes], as [rows, blocks]."""
    return fields[..., start : start + 2].contiguous().view(torch.float16)[..., 0]


def _split_q4_0(b: torch.Tensor) -> Planes:
    return {"d": _f16(b, 0), "qs": b[..., 2:].contiguous()}


def _split_q5_0(b: torch.Tensor) -> Planes:
    return {"d": _f16(b, 0), "qh": b[..., 2:6].contiguous(), "qs": b[..., 6:].contiguous()}


def _split_q8_0(b: torch.Tensor) -> Planes:
    return {"d": _f16(b, 0), "qs": b[..., 2:].contiguous().view(torch.int8)}


def _split_q4_k(b: torch.Tensor) -> Planes:
    rows, blocks, _ = b.shape
    sc, mn = k_scales(b[..., 4:16].reshape(-1, 12))
    return {
        "d": _f16(b, 0),
        "dmin": _f16(b, 2),
        "sc": sc.reshape(rows, blocks, 8),
        "mn": mn.reshape(rows, blocks, 8),
        "qs": b[..., 16:].contiguous(),
    }


def _split_q6_k(b: torch.Tensor) -> Planes:
    return {
        "ql": b[..., :128].contiguous(),
        "qh": b[..., 128:192].contiguous(),
        "scales": b[..., 192:208].contiguous().view(torch.int8),
        "d": _f16(b, 208),
    }


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# Each returns [rows, blocks, block_size] float32, the values gguf dequantizes to
# (the same float operations in the same order as llmrun.quant.blocks).
def _q4_0(p: Planes) -> torch.Tensor:
    rows, blocks, _ = p["qs"].shape
    q = nibbles(_flat(p["qs"]), 1, 16).reshape(rows, blocks, 32)
    return p["d"].float()[..., None] * (q.to(torch.int8) - 8).float()


def _q5_0(p: Planes) -> torch.Tensor:
    rows, blocks, _ = p["qs"].shape
    shifts = torch.arange(8, dtype=torch.uint8, device=p["qh"].device).reshape(1, 1, 1, 8)
    high = ((p["qh"][..., None] >> shifts) & 1).reshape(rows, blocks, 32)
    q = nibbles(_flat(p["qs"]), 1, 16).reshape(rows, blocks, 32) | (high << 4)
    return p["d"].float()[..., None] * (q.to(torch.int8) - 16).float()


def _q8_0(p: Planes) -> torch.Tensor:
    return p["qs"].float() * p["d"].float()[..., None]


def _q4_k(p: Planes) -> torch.Tensor:
    rows, blocks, _ = p["qs"].shape
    d = (p["d"].float()[..., None] * p["sc"].float())[..., None]
    dm = (p["dmin"].float()[..., None] * p["mn"].float())[..., None]
    q = nibbles(_flat(p["qs"]), 4, 32).reshape(rows, blocks, 8, 32).float()
    return (d * q - dm).reshape(rows, blocks, QK_K)


def _q6_k(p: Planes) -> torch.Tensor:
    rows, blocks, _ = p["ql"].shape
    low = nibbles(_flat(p["ql"]), 2, 64).reshape(-1, 8, 32)
    q = (low | (crumbs(_flat(p["qh"]), 2) << 4)).to(torch.int8) - 32
    d = (p["d"].float()[..., None] * p["scales"].float())[..., None]
    return (d * q.reshape(rows, blocks, 16, 16).float()).reshape(rows, blocks, QK_K)


SPLIT: dict[GGMLQuantizationType, Callable[[torch.Tensor], Planes]] = {
    T.Q4_0: _split_q4_0,
    T.Q5_0: _split_q5_0,
    T.Q8_0: _split_q8_0,
    T.Q4_K: _split_q4_k,
    T.Q6_K: _split_q6_k,
}
DEQUANTIZE: dict[GGMLQuantizationType, Callable[[Planes], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q5_0: _q5_0,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q6_K: _q6_k,
}
TYPES = frozenset(SPLIT)


def split(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Planes:
    """Raw GGML rows uint8 [rows, row_bytes] (whole blocks) as planes."""
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    blocks = raw.reshape(raw.shape[0], -1, type_size)
    return SPLIT[ggml_type](blocks)


def dequantize(
    planes: Planes, ggml_type: GGMLQuantizationType, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights [rows, in_features] of `planes`, in `dtype`."""
    values = DEQUANTIZE[ggml_type](planes)
    return values.reshape(values.shape[0], -1).to(dtype)


def matvec(x: torch.Tensor, planes: Planes, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """x [rows, in] times the weights' transpose, [rows, out] in f32: the products and
    sums written out for torch.compile to fuse (see the module docstring)."""
    w = DEQUANTIZE[ggml_type](planes)  # [out, blocks, block_size]
    xb = x.float().reshape(x.shape[0], 1, *w.shape[1:])
    return (w[None] * xb).sum(-1).sum(-1)


class PlanarLinear(nn.Module):
    """A linear layer whose quantized weight is held as planes (see the module docstring).

    `fused`: the product for up to FUSED_MAX_ROWS rows (matvec, compiled where that
    pays: PlanarLinear.compiled); None, or more rows: dequantized tiles and F.linear
    in the activations' dtype.
    """

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        in_features: int,
        bias: torch.Tensor | None = None,
        fused: Callable | None = None,
    ) -> None:
        super().__init__()
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.in_features, self.out_features = in_features, raw.shape[0]
        self.names = []
        for name, plane in split(raw, self.ggml_type).items():
            self.register_buffer(f"plane_{name}", plane)
            self.names.append(name)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.fused = fused

    @staticmethod
    def compiled() -> Callable:
        """matvec through torch.compile: fused kernels per type, for any shape."""
        # Shapes are symbolic so that a model's matrices share a compile per type;
        # types and row counts past the first still compile again, more than dynamo's
        # default limit of 8 allows before it falls back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(matvec, dynamic=True, fullgraph=True)

    @property
    def planes(self) -> Planes:
        return {name: getattr(self, f"plane_{name}") for name in self.names}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.fused is not None and x2.shape[0] <= FUSED_MAX_ROWS:
            y = self.fused(x2, self.planes, self.ggml_type).to(x.dtype)
        else:
            y = self._tiles(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _tiles(self, x2: torch.Tensor) -> torch.Tensor:
        """Dequantized tiles of rows times x2, so no full-size copy of the weight is made."""
        rows = max(TILE_WEIGHTS // self.in_features, 1)
        if rows >= self.out_features:
            return F.linear(x2, dequantize(self.planes, self.ggml_type, x2.dtype))
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
        for r0 in range(0, self.out_features, rows):
            tile = {name: p[r0 : r0 + rows] for name, p in self.planes.items()}
            y[:, r0 : r0 + rows] = F.linear(x2, dequantize(tile, self.ggml_type, x2.dtype))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.ggml_type.name}, planes={','.join(self.names)}"
        )


def convert(model: nn.Module, fused: Callable | None = None) -> int:
    """Swap every QuantLinear of a type here (experts and a tied lm_head included: the
    head gets a copy, the embedding keeps the blocks it looks up) for a PlanarLinear of
    its weight with `fused`; how many it swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, QuantLinear) or child.ggml_type not in TYPES:
                continue
            raw = child.weight
            if child.packed:
                raw = kernels.unpack(raw, child.ggml_type)
            bias = None if child.bias is None else child.bias.detach()
            new = PlanarLinear(raw.detach(), child.ggml_type, child.in_features, bias, fused)
            setattr(module, name, new)
            swapped += 1
    return swapped
