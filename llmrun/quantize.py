"""`llmrun quantize`: write a GGUF model with its tensors quantized under a llama-quantize
preset, as llama-quantize writes it.

The types come from llmrun.quant.presets; the blocks from the native library's
quantizers (llmrun/native/quantize.c), bit-identical to ggml's, weighted by an importance
matrix where one is given (llmrun.imatrix: each tensor's row, each expert's of a stack of
experts, checked as llama-quantize checks them). The output holds every metadata entry
of the input, with general.quantization_version and general.file_type set last (split
keys dropped; then llama-quantize's quantize.imatrix.* entries where given), and the
tensors in llama.cpp's order at the input's alignment. Tensors stream through in slabs
of rows, so memory stays near a slab whatever the model's size; the file is written
under a temporary name beside the output and renamed at the end, so an interrupted run
leaves no half file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, Keys

from llmrun import native
from llmrun.errors import LlmrunError, ModelFormatError, UnsupportedError, UsageError
from llmrun.loading import gguf_io
from llmrun.quant import blocks, kernels, quantize_iq
from llmrun.quant.presets import (
    FLOAT_TYPES,
    WRITABLE,
    Model,
    Overrides,
    Preset,
    choose_types,
    is_quantized,
    requires_imatrix,
    tensor_order,
)

T = GGMLQuantizationType
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
SLAB_BYTES = 64 << 20  # f32 rows quantized at a time
_TOKEN_EMBEDDINGS = ("token_embd.weight", "per_layer_token_embd.weight")
_DROPPED_KEYS = {
    Keys.General.QUANTIZATION_VERSION,
    Keys.General.FILE_TYPE,
    Keys.Split.LLM_KV_SPLIT_NO,
    Keys.Split.LLM_KV_SPLIT_COUNT,
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the output: where it comes from and the type it gets."""

    info: gguf_io.GGUFTensorInfo
    new_type: GGMLQuantizationType

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.info.shape))

    @property
    def new_nbytes(self) -> int:
        size, type_size = GGML_QUANT_SIZES[self.new_type]
        return int(np.prod(self.info.shape)) // size * type_size


@dataclass(frozen=True)
class Summary:
    """What a quantization wrote."""

    tensors: int
    bytes_before: int
    bytes_after: int
    parameters: int


Progress = Callable[[int, int, TensorPlan], None]


def model_facts(gg: gguf_io.GGUFFile) -> Model:
    """The metadata the type rules read (llama.cpp's hparams), first layer's head counts."""
    meta = gguf_io.ArchMetadata.of(gg)

    def first(value: Any, default: int) -> int:
        value = value[0] if isinstance(value, list) and value else value
        return value if isinstance(value, int) else default

    n_head = first(meta.get(Keys.Attention.HEAD_COUNT), 0)
    n_layer = first(meta.get(Keys.LLM.BLOCK_COUNT), 0)
    if n_layer <= 0:
        raise ModelFormatError(f"{gg.path}: no {meta.name(Keys.LLM.BLOCK_COUNT)} in the metadata")
    return Model(
        arch=gg.architecture,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=first(meta.get(Keys.Attention.HEAD_COUNT_KV), n_head),
        n_expert=first(meta.get(Keys.LLM.EXPERT_COUNT), 0),
    )


def plan(
    gg: gguf_io.GGUFFile, preset: Preset, overrides: Overrides, has_imatrix: bool = False
) -> list[TensorPlan]:
    """Each tensor of `gg` in output order with its new type (some rules differ where an
    importance matrix is given: `has_imatrix`)."""
    names = tensor_order(gg.tensors)
    infos = [gg.tensors[name] for name in names]
    described = [(i.name, i.ggml_type, tuple(reversed(i.shape))) for i in infos]
    types = choose_types(described, model_facts(gg), preset, overrides, has_imatrix=has_imatrix)
    for info, new_type in zip(infos, types, strict=True):
        if new_type != info.ggml_type and new_type not in WRITABLE:
            raise UnsupportedError(f"tensor {info.name!r}: llmrun cannot write {new_type.name}")
    return [TensorPlan(info, new_type) for info, new_type in zip(infos, types, strict=True)]


def check_paths(source: Path, target: Path) -> None:
    """Refuse to write over the input, or into a folder that is not there."""
    if target.is_dir():
        raise UsageError(f"{target}: is a directory; give the output file's name")
    if not target.parent.is_dir():
        raise UsageError(f"{target.parent}: no such directory for the output")
    same = target.exists() and source.exists() and os.path.samefile(source, target)
    if same or source.resolve() == target.resolve():
        raise UsageError(f"the output {target} is the input file: give another name")


def check_conversions(plans: list[TensorPlan], allow_requantize: bool) -> None:
    """Each tensor that changes type must be a float or block type; quantized ones only
    with `allow_requantize`, as llama-quantize has it."""
    for p in plans:
        old = p.info.ggml_type
        if p.new_type == old or old in FLOAT_TYPES:
            continue
        if not is_quantized(old):
            raise UnsupportedError(f"tensor {p.info.name!r} of type {old.name} cannot be converted")
        if not allow_requantize:
            raise UsageError(
                f"tensor {p.info.name!r} is already quantized ({old.name}): "
                "requantizing loses quality; pass --allow-requantize to do it anyway"
            )


def quantize_file(
    source: str | Path,
    target: str | Path,
    preset: Preset,
    overrides: Overrides | None = None,
    *,
    allow_requantize: bool = False,
    threads: int = 1,
    progress: Progress | None = None,
    imatrix: Mapping[str, np.ndarray] | None = None,
    metadata: Sequence[tuple[str, str | int]] = (),
) -> Summary:
    """Quantize the GGUF model `source` into `target` (replaced if it exists). `imatrix`:
    an importance matrix, tensor name -> per-column importances (experts one after
    another), as llama-quantize reads one (llmrun.imatrix.Imatrix.means); `metadata`:
    entries written after general.file_type, a string or a u32 each (llama-quantize's
    quantize.imatrix.* of the imatrix file)."""
    source, target = Path(source).expanduser(), Path(target).expanduser()
    check_paths(source, target)
    if native.library() is None:
        raise UnsupportedError(f"llmrun quantize needs the native library ({native.status()})")
    gg = gguf_io.read_model_gguf(source)
    plans = plan(gg, preset, overrides or Overrides(), has_imatrix=imatrix is not None)
    check_conversions(plans, allow_requantize)
    importance = importance_rows(plans, imatrix, preset) if imatrix is not None else {}
    alignment = gg.get(Keys.General.ALIGNMENT, gguf_io.DEFAULT_ALIGNMENT)
    header = min((i.offset for i in gg.tensors.values() if i.part == 0), default=0)
    needed = header + sum(-(-p.new_nbytes // alignment) * alignment for p in plans)
    free = shutil.disk_usage(target.parent).free
    if needed > free:
        raise LlmrunError(
            f"{target.parent}: not enough free disk space: the output needs about "
            f"{needed / 1e9:.2f} GB, {free / 1e9:.2f} GB is free"
        )
    temporary = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        _write(gg, plans, preset, temporary, alignment, threads, progress, importance, metadata)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return Summary(
        tensors=len(plans),
        bytes_before=sum(p.info.nbytes for p in plans),
        bytes_after=sum(p.new_nbytes for p in plans),
        parameters=sum(int(np.prod(p.info.shape)) for p in plans),
    )


def importance_rows(
    plans: list[TensorPlan], imatrix: Mapping[str, np.ndarray], preset: Preset
) -> dict[str, np.ndarray]:
    """The importance rows [experts or 1, columns] of each tensor that changes type, by
    name, from an importance matrix checked as llama-quantize checks it: finite values,
    and as many as the tensor's columns times its experts (token embeddings of another
    size are quantized without, as llama-quantize does). Tensors it has no entry for go
    without, but for those of a type that needs one; a matrix without an entry for any
    tensor of the model is refused."""
    for name, values in imatrix.items():
        if not np.isfinite(values).all():
            raise UsageError(f"the importance matrix's entry {name!r} holds NaN or infinite values")
    if not any(p.info.name in imatrix for p in plans):
        raise UsageError(
            f"none of the importance matrix's {len(imatrix)} entries names a tensor of the "
            "model: was it computed for another model?"
        )
    rows = {}
    for p in plans:
        values = imatrix.get(p.info.name)
        if values is None or p.new_type == p.info.ggml_type:
            continue
        n_cols = p.info.shape[-1]
        experts = p.info.shape[0] if len(p.info.shape) == 3 else 1
        if np.size(values) != n_cols * experts:
            if p.info.name in _TOKEN_EMBEDDINGS:
                continue
            raise UsageError(
                f"the importance matrix has {np.size(values)} values for tensor "
                f"{p.info.name!r}, which takes {n_cols * experts}: was it computed for "
                "another model?"
            )
        rows[p.info.name] = np.asarray(values, np.float32).reshape(experts, n_cols)
    for p in plans:
        needs = requires_imatrix(p.info.name, p.new_type, preset)
        if needs and p.new_type != p.info.ggml_type and p.info.name not in rows:
            raise UsageError(
                f"the importance matrix has no entry for tensor {p.info.name!r}, which "
                f"{preset.name} makes {p.new_type.name}: a very low-bit type needs one"
            )
    return rows


class _Stored(bytes):
    """A metadata value's bytes as the input file stores them."""


class _CopyingWriter(GGUFWriter):
    """GGUFWriter that writes _Stored values unchanged, and no entry of its own."""

    def add_architecture(self) -> None:
        pass  # the copied entries hold general.architecture where the input has it

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type=None) -> bytes:
        if isinstance(val, _Stored):
            return (self._pack("I", vtype) if add_vtype else b"") + bytes(val)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _write(
    gg: gguf_io.GGUFFile,
    plans: list[TensorPlan],
    preset: Preset,
    path: Path,
    alignment: int,
    threads: int,
    progress: Progress | None,
    importance: dict[str, np.ndarray],
    metadata: Sequence[tuple[str, str | int]],
) -> None:
    writer = _CopyingWriter(path, gg.architecture)
    writer.data_alignment = alignment
    replaced = {key for key, _ in metadata}
    for key, vtype, stored in gguf_io.stored_metadata(gg):
        if key not in _DROPPED_KEYS and key not in replaced:
            writer.add_key_value(key, _Stored(stored), vtype)
    writer.add_quantization_version(QUANTIZATION_VERSION)
    writer.add_file_type(int(preset.file_type))
    for key, value in metadata:  # as gguf_set_val_*: an input's entry moves to the end
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for p in plans:
        writer.add_tensor_info(p.info.name, p.info.shape, np.float32, p.new_nbytes, p.new_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        for index, p in enumerate(plans):
            if progress is not None:
                progress(index, len(plans), p)
            for chunk in _tensor_bytes(gg, p, threads, importance.get(p.info.name)):
                out.write(chunk)
            writer.write_padding(out, p.new_nbytes)
        writer.flush()
        os.fsync(out.fileno())
    finally:
        writer.close()


def _tensor_bytes(
    gg: gguf_io.GGUFFile, p: TensorPlan, threads: int, importance: np.ndarray | None = None
) -> Iterator[memoryview]:
    """The tensor's data in its new type, a slab of rows at a time (with `importance`,
    [experts, columns], no slab crosses from one expert's rows to the next's)."""
    info = p.info
    raw = np.frombuffer(gg.buffers[info.part], np.uint8, info.nbytes, info.offset)
    n_cols = info.shape[-1]
    rows = int(np.prod(info.shape[:-1]))
    row_bytes = info.nbytes // rows
    step = max(1, SLAB_BYTES // (4 * n_cols))
    per_expert = rows if importance is None else rows // len(importance)
    for expert_start in range(0, rows, per_expert):
        expert_end = expert_start + per_expert
        row = None if importance is None else importance[expert_start // per_expert]
        for first in range(expert_start, expert_end, step):
            slab = raw[first * row_bytes : min(expert_end, first + step) * row_bytes]
            if p.new_type == info.ggml_type:
                yield memoryview(slab)
                continue
            weights = _as_f32(slab.reshape(-1, row_bytes), info.ggml_type, n_cols)
            if not np.isfinite(weights).all():
                raise ModelFormatError(
                    f"{gg.path}: tensor {info.name!r} holds NaN or infinite values"
                )
            yield memoryview(quantize_rows(weights, p.new_type, threads, row))


def _as_f32(rows: np.ndarray, ggml_type: GGMLQuantizationType, n_cols: int) -> np.ndarray:
    """Rows of `ggml_type` bytes as f32 `[rows, n_cols]`, exactly (llama.cpp's to_float)."""
    if ggml_type == T.F32:
        return rows.view(np.float32)
    if ggml_type == T.F16:
        # torch's conversion is vectorized (F16C) where numpy's is not: twice as fast.
        return torch.from_numpy(rows.view(np.float16)).float().numpy()
    if ggml_type == T.BF16:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    tensor = torch.from_numpy(rows)
    if kernels.supports(ggml_type, n_cols):
        return kernels.dequantize(tensor, ggml_type).numpy()
    return blocks.dequantize(tensor, ggml_type).numpy()


def quantize_rows(
    weights: np.ndarray,
    ggml_type: GGMLQuantizationType,
    threads: int = 1,
    imatrix: np.ndarray | None = None,
) -> np.ndarray:
    """f32 rows `[rows, n]` as `ggml_type`'s bytes, as ggml's quantizer (ggml_quantize_chunk)
    writes them: with `imatrix`, n f32 importances of the columns (an importance matrix's
    row for this tensor or expert), the weighted search where the type has one."""
    if ggml_type in quantize_iq.TYPES:
        return quantize_iq.quantize_rows(weights, ggml_type, threads, imatrix)
    lib = native.library()
    if lib is None:
        raise UnsupportedError(f"quantizing needs the native library ({native.status()})")
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    rows, n_cols = weights.shape
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_cols,):
            raise UsageError(
                f"an importance row of {imatrix.size} values does not fit rows of {n_cols}"
            )
    size, type_size = GGML_QUANT_SIZES[ggml_type]
    out = np.empty(rows * (n_cols // size) * type_size, dtype=np.uint8)
    written = lib.llmrun_quantize(
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
