"""QuantLinear and QuantEmbedding: nn.Linear and nn.Embedding over raw GGML blocks.

The raw blocks are kept as they are in the file (a zero-copy view of the mapped
GGUF where possible) and dequantized on use: on CPU by the native kernels where
they are available (a matvec for decode, dequantized tiles and a GEMM for
prefill), otherwise by the torch dequantizers. Products are computed in f32.
The blocks are held as frozen Parameters named `weight`, so state-dict keys match
the HF names and a tied lm_head/embedding pair stays one tensor through
`.to(device)` (buffers would be copied once per module). To tie, pass one
module's `weight` to the other.

Exception to "as in the file": with the native kernels (AVX-512 or AVX2), a
QuantLinear given its own Q4_0 or Q5_0 tensor, or Q4_K or Q5_K with the AVX-512
kernels (kernels.PACKED), repacks it once into kernels.pack's layout (same size; the
file's view is dropped), whose kernel is ~1.3-1.5x faster (Q4_K, Q5_K: ~1.2-1.3x);
`packed` says so, and its `weight` (and state dict) then holds that layout. A tied
weight (a Parameter) is not repacked by QuantLinear; `tied_head` packs the embedding
and the lm_head together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.quant import blocks, kernels
from llmrun.quant.blocks import check_supported, row_bytes

# Up to this many activation rows (decode, small batches, short prompts) a native
# matvec takes them in passes of 8 over each L2-sized run of blocks; past it,
# dequantized tiles and a GEMM are faster (Zen 4: Qwen2.5-7B's shapes break even at
# ~128 rows, 0.5B's past 256; at 16, a 32-token prompt took 2.4-2.9x longer).
MATVEC_MAX_ROWS = 128
# f32 weights dequantized per GEMM tile, so a 150k-row lm_head never makes a huge temporary.
TILE_WEIGHTS = 1 << 22


def _check_raw(raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int) -> None:
    check_supported(ggml_type)
    expected = row_bytes(ggml_type, n_cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected:
        raise ModelFormatError(
            f"{ggml_type.name} weight with rows of {n_cols} values needs uint8 "
            f"[rows, {expected}] blocks, got {raw.dtype} {list(raw.shape)}"
        )


def _native_ok(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int, packed: bool = False
) -> bool:
    return (
        raw.device.type == "cpu"
        and raw.stride(-1) == 1
        and kernels.supports(ggml_type, n_cols, packed)
    )


def _f32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


def _frozen(raw: torch.Tensor) -> nn.Parameter:
    return raw if isinstance(raw, nn.Parameter) else nn.Parameter(raw, requires_grad=False)


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored as GGML blocks, uint8 `[out_features, row_bytes]`.

    The native matvec is bound to the weight and bias at the first call, and again
    after `.to()` or `load_state_dict`; its bias is added inside the kernel. With
    `q8_activations` set (set_activations), every product goes through the
    8-bit-activation kernel where the type has one (kernels.supports_q8): the
    activations quantized to Q8_0 (K-quants: Q8_K) as llama.cpp does, faster and no
    longer exact.
    """

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        _check_raw(raw, ggml_type, in_features)
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.packed = (
            not isinstance(raw, nn.Parameter)
            and raw.device.type == "cpu"
            and kernels.supports(self.ggml_type, in_features, packed=True)
        )
        self.weight = _frozen(kernels.pack(raw, self.ggml_type) if self.packed else raw)
        if bias is not None and bias.shape != (self.out_features,):
            raise ModelFormatError(
                f"bias of shape {list(bias.shape)} does not fit {self.out_features} outputs"
            )
        self.bias = None if bias is None else _frozen(bias)
        self._matvec: kernels.Matvec | None = None
        self._stale = True
        self._matvec_max = MATVEC_MAX_ROWS * in_features
        self.q8_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matvec = self._native() if self._stale else self._matvec
        # 8-bit activations take the kernel for any number of rows: integer products on
        # a prompt too, as llama.cpp computes them; so do f32 rows where the family has
        # its own GEMM (Matvec.gemm). Else f32 tiles go to torch's GEMM.
        if matvec is not None and (x.numel() <= self._matvec_max or matvec.gemm is not None):
            if x.dtype == torch.float32 and x.is_contiguous():
                # Decoding: the path every token takes, kept to one call.
                return matvec(x).view(*x.shape[:-1], self.out_features)
            y = matvec(x.float().contiguous())
        else:
            x2 = x.reshape(-1, self.in_features).float()
            if matvec is not None:
                y = self._gemm(x2, lambda w: kernels.dequantize(w, self.ggml_type, self.packed))
            else:
                y = self._gemm(x2, self._torch_dequantize)
            if self.bias is not None:
                y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        # .to(), .float(), ... may move or convert the weight or bias: bind again.
        self._stale = True
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._stale = True  # load_state_dict(assign=True) replaces the tensors
        return super()._load_from_state_dict(*args, **kwargs)

    def _native(self) -> kernels.Matvec | None:
        """The bound native matvec (bias included) for the current weight, or None for
        the torch path."""
        ok = _native_ok(self.weight, self.ggml_type, self.in_features, self.packed)
        q8 = self.q8_activations and kernels.supports_q8(
            self.ggml_type, self.in_features, self.packed
        )
        self._matvec = (
            kernels.Matvec(self.weight, self.ggml_type, self.packed, _f32(self.bias), q8)
            if ok
            else None
        )
        self._stale = False
        return self._matvec

    def _torch_dequantize(self, w: torch.Tensor) -> torch.Tensor:
        return blocks.dequantize(
            kernels.unpack(w, self.ggml_type) if self.packed else w, self.ggml_type
        )

    def _gemm(self, x2: torch.Tensor, dequantize) -> torch.Tensor:
        tiles = -(-self.out_features * self.in_features // TILE_WEIGHTS)
        if tiles <= 1:
            return F.linear(x2, dequantize(self.weight))
        rows = -(-self.out_features // tiles)  # tiles of equal size: no thin last GEMM
        y = torch.empty(x2.shape[0], self.out_features, device=x2.device)
        for r0 in range(0, self.out_features, rows):
            y[:, r0 : r0 + rows] = F.linear(x2, dequantize(self.weight[r0 : r0 + rows]))
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, type={self.ggml_type.name}"
            + (" (packed)" if self.packed else "")
        )


class QuantEmbedding(nn.Module):
    """Token embeddings stored as GGML blocks; a lookup dequantizes only the rows it reads.
    `packed`: the rows are in kernels.pack's layout (set by `tied_head`)."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        embedding_dim: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        _check_raw(raw, ggml_type, embedding_dim)
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = embedding_dim
        self.dtype = compute_dtype
        self.weight = _frozen(raw)
        self.packed = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        if _native_ok(rows, self.ggml_type, self.embedding_dim, self.packed):
            out = kernels.dequantize(rows, self.ggml_type, self.packed).to(self.dtype)
        else:
            if self.packed:
                rows = kernels.unpack(rows, self.ggml_type)
            out = blocks.dequantize(rows, self.ggml_type, self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}" + (
            " (packed)" if self.packed else ""
        )


ACTIVATIONS = ("f32", "q8")


def set_activations(model: nn.Module, activations: str) -> int:
    """How the model's quantized linear layers meet their activations when decoding:
    "f32" (exact products, the default) or "q8" (quantized to Q8_0 or Q8_K first, where the
    kernels have such a matvec for the type). Returns how many layers take q8."""
    from llmrun.quant.experts import ExpertList  # which imports this module

    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.q8_activations = activations == "q8"
            module._stale = True
            count += module.q8_activations and kernels.supports_q8(
                module.ggml_type, module.in_features, module.packed
            )
        elif isinstance(module, ExpertList):
            module._stale = True  # its plan picks its calls by its modules' setting
    step = getattr(model, "decode_step", None)  # llmrun.quant.decode_step
    if step is not None:
        step.invalidate()
    return count


def tied_head(embedding: QuantEmbedding) -> QuantLinear:
    """An lm_head that shares the embedding's blocks (one Parameter, also through
    `.to()`). Where the type has a packed layout and the native kernels take it, both
    switch to it: the head's matvec reads every row each token, a lookup a few."""
    raw, ggml_type, dim = embedding.weight, embedding.ggml_type, embedding.embedding_dim
    if embedding.packed or not _native_ok(raw, ggml_type, dim, packed=True):
        head = QuantLinear(raw, ggml_type, dim)
        head.packed = embedding.packed
        return head
    head = QuantLinear(raw.detach(), ggml_type, dim)  # a plain tensor: packed into a copy
    embedding.weight, embedding.packed = head.weight, True
    return head
