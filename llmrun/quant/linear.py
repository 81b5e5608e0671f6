"""QuantLinear and QuantEmbedding: nn.Linear and nn.Embedding over raw GGML blocks.

The raw blocks are kept as they are in the file (a zero-copy view of the mapped
GGUF where possible) and dequantized on use. They are held as frozen
Parameters named `weight`, so state-dict keys match the HF names and a tied
lm_head/embedding pair stays one tensor through `.to(device)` (buffers would
be copied once per module). To tie, pass one module's `weight` to the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.quant.blocks import check_supported, dequantize, row_bytes


def _check_raw(raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_cols: int) -> None:
    check_supported(ggml_type)
    expected = row_bytes(ggml_type, n_cols)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != expected:
        raise ModelFormatError(
            f"{ggml_type.name} weight with rows of {n_cols} values needs uint8 "
            f"[rows, {expected}] blocks, got {raw.dtype} {list(raw.shape)}"
        )


def _frozen(raw: torch.Tensor) -> nn.Parameter:
    return raw if isinstance(raw, nn.Parameter) else nn.Parameter(raw, requires_grad=False)


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored as GGML blocks, uint8 `[out_features, row_bytes]`."""

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
        self.weight = _frozen(raw)
        if bias is not None and bias.shape != (self.out_features,):
            raise ModelFormatError(
                f"bias of shape {list(bias.shape)} does not fit {self.out_features} outputs"
            )
        self.bias = None if bias is None else _frozen(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, self.ggml_type)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), w, bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, type={self.ggml_type.name}"
        )


class QuantEmbedding(nn.Module):
    """Token embeddings stored as GGML blocks; a lookup dequantizes only the rows it reads."""

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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.ggml_type, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}"
