"""A GGUF's fused stack of experts cut into the two stacks llmrun's models hold.

llama.cpp's converter writes each MoE layer's gate and up experts as one tensor,
blk.N.ffn_gate_up_exps [experts, 2 * width, hidden], when asked (`--fuse-gate-up-exps`,
conversion/base.py: each expert's gate rows, then its up rows), and llama.cpp's loader
takes it in place of ffn_gate_exps and ffn_up_exps (create_tensor_gate_up_exps). Both
halves are views of the file's bytes: rows of GGML blocks stay whole, nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.loading.gguf_io import GGUFTensorInfo

FUSED = "ffn_gate_up_exps"
PARTS = ("ffn_gate_exps", "ffn_up_exps")  # the order of the halves


def is_fused(name: str) -> bool:
    """Whether a GGUF tensor name is a fused gate_up stack of experts."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] == FUSED


def halves(info: GGUFTensorInfo, tensor: Any) -> Iterator[tuple[GGUFTensorInfo, Any]]:
    """The gate and up stacks of a fused one, each as the info of a stack of its own and a
    view [experts, width, row] of `tensor` (load_tensor's: float [experts * 2 * width,
    hidden] or block bytes [experts * 2 * width, row bytes])."""
    if len(info.shape) != 3 or info.shape[1] % 2:
        raise ModelFormatError(
            f"tensor {info.name!r} has shape {list(info.shape)}: a fused gate_up stack "
            "holds [experts, 2 * width, hidden]"
        )
    experts, rows, _ = info.shape
    width = rows // 2
    stacked = tensor.reshape(experts, rows, -1)
    for i, part in enumerate(PARTS):
        shape = (experts, width, info.shape[2])
        yield (
            replace(
                info, name=info.name.replace(FUSED, part), shape=shape, nbytes=info.nbytes // 2
            ),
            stacked[:, i * width : (i + 1) * width],
        )
