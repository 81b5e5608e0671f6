"""Importance matrices as llama.cpp's llama-imatrix computes them, and their files.

An importance matrix holds, for each weight matrix the model multiplies activations
with, the sum over the tokens of a text of each input column's squared activation, and
how many tokens went in (per expert for a stack of experts). llama-quantize weighs each
weight's rounding error by that column's mean (llmrun/native/quantize.c).

Collection: forward pre-hooks on the model's linear layers (nn.Linear, QuantLinear,
PlanarLinear), keyed by the GGUF name of each one's weight (and expert), put in place
only while collecting, so normal runs pay nothing. The layers are the ones llama-imatrix
collects: those of `blk.*` tensors, and output.weight with `process_output` (a tied
output is token_embd.weight, which it never collects). The text is cut as
llama-perplexity cuts it (llmrun.perplexity.text_chunks) and every token of each chunk
goes through the model. llama-imatrix leaves out dense products over fewer than 16
tokens (its ubatches, which depend on how many chunks it decodes together): llmrun
leaves out the same tokens (dense_positions).

Files: llama.cpp's GGUF imatrix (general.type "imatrix", imatrix.datasets,
imatrix.chunk_count, imatrix.chunk_size; per entry, by name, `<name>.in_sum2` f32
[experts, columns] and `<name>.counts` f32 [experts, 1], a dense matrix's [columns] and
[1]) and the legacy .dat (per entry: name, ncall, the values as sum / count * ncall;
then the chunk count and the dataset).
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from torch import nn

from llmrun.errors import ModelFormatError, UsageError
from llmrun.loading import gguf_config, gguf_io
from llmrun.perplexity import Estimate, NewCache, estimates
from llmrun.quant.linear import QuantLinear
from llmrun.quant.planes import PlanarLinear

# llama-imatrix's batches: n_batch tokens (2048 // n_ctx chunks together), split into
# ubatches of n_ubatch; it leaves out dense products over fewer than MIN_TOKENS.
BATCH, UBATCH, MIN_TOKENS = 2048, 512, 16
PIECE = 512  # tokens a forward: a long chunk goes through its cache in pieces
FORMATS = ("gguf", "dat")
KEY_TYPE = "general.type"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUM_SUFFIX, COUNT_SUFFIX = ".in_sum2", ".counts"
_LINEAR = (nn.Linear, QuantLinear, PlanarLinear)


@dataclass
class Entry:
    """One matrix's (or stack of experts') statistics."""

    sums: np.ndarray  # float32 [experts or 1, columns]: sums of squared activations
    counts: np.ndarray  # int64 [experts or 1]: the tokens each matrix took

    def means(self) -> np.ndarray:
        """The per-column mean squares, experts one after another, as llama-quantize
        computes them from a GGUF imatrix (1 where a matrix saw no token)."""
        counts = self.counts.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            means = np.where(counts > 0, self.sums / counts, np.float32(1))
        return means.astype(np.float32).reshape(-1)


@dataclass
class Imatrix:
    """An importance matrix: entries by GGUF tensor name, and how it was computed."""

    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    # A legacy .dat file's values are already means times ncall, its counts [ncall].
    legacy: bool = False

    def means(self) -> dict[str, np.ndarray]:
        """Tensor name -> per-column importances (experts concatenated), as llama-quantize
        passes them to the quantizers."""
        if not self.legacy:
            return {name: e.means() for name, e in self.entries.items()}
        out = {}
        for name, e in self.entries.items():
            ncall = int(e.counts[0]) if e.counts.size else 0
            values = e.sums.reshape(-1)
            out[name] = (values / np.float32(ncall) if ncall > 0 else values).astype(np.float32)
        return out


# ---- collection ----


@dataclass(frozen=True)
class Target:
    """A linear layer whose inputs are collected, under its weight's GGUF name."""

    module: nn.Module
    name: str
    expert: int | None = None  # its index in a stack of `experts`
    experts: int = 1


def targets(
    model: nn.Module, gg: gguf_io.GGUFFile, model_type: str, process_output: bool = False
) -> list[Target]:
    """The linear layers llama-imatrix collects of `model` (of `model_type`), loaded from
    the GGUF `gg`: those of `blk.*` weights (and output.weight with `process_output`),
    each expert of a stack of experts on its own. Tensors that are not one linear layer's
    weight in llmrun's model, with the file's columns (fused or split at load), have
    none."""
    found = []
    for info in gg.tensors.values():
        name = info.name
        if not (name.startswith("blk.") or (process_output and name == "output.weight")):
            continue
        hf = gguf_config.hf_name(name, model_type)
        if hf is None or not hf.endswith(".weight") or len(info.shape) not in (2, 3):
            continue
        columns = info.shape[-1]
        if "{expert}" in hf and len(info.shape) == 3:
            count = info.shape[0]
            for e in range(count):
                module = _linear(model, hf.format(expert=e), columns)
                if module is not None:
                    found.append(Target(module, name, e, count))
        elif "{expert}" not in hf and (module := _linear(model, hf, columns)) is not None:
            found.append(Target(module, name))
    return found


def _linear(model: nn.Module, key: str, columns: int) -> nn.Module | None:
    """The linear layer whose weight is `key`, where it takes `columns` inputs."""
    try:
        module = model.get_submodule(key.removesuffix(".weight"))
    except AttributeError:
        return None
    linear = isinstance(module, _LINEAR) and module.in_features == columns
    return module if linear else None


class Collector:
    """Sums of squared inputs of `targets`' layers while in a `with` block: the hooks
    are there only then. `dense` (set per forward) selects the token rows that dense
    products count (None: all)."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets
        self.sums: dict[str, torch.Tensor] = {}  # float64 [experts, columns]
        self.counts: dict[str, torch.Tensor] = {}  # int64 [experts]
        self.dense: torch.Tensor | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> Collector:
        self._handles = [t.module.register_forward_pre_hook(self._hook(t)) for t in self.targets]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, target: Target) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])
            if target.expert is None and self.dense is not None and len(self.dense) == len(x):
                x = x[self.dense.to(x.device)]
            if len(x) == 0:
                return
            sums = self.sums.get(target.name)
            if sums is None:
                sums = self.sums[target.name] = torch.zeros(
                    target.experts, x.shape[1], dtype=torch.float64
                )
                self.counts[target.name] = torch.zeros(target.experts, dtype=torch.int64)
            square = x.double().square().sum(0).cpu()
            if not torch.isfinite(square).all():
                raise ModelFormatError(f"non-finite activations going into {target.name}")
            row = 0 if target.expert is None else target.expert
            sums[row] += square
            self.counts[target.name][row] += len(x)

        return hook

    def imatrix(self, datasets: list[str], chunk_count: int, chunk_size: int) -> Imatrix:
        entries = {
            name: Entry(sums.float().numpy(), self.counts[name].numpy().copy())
            for name, sums in sorted(self.sums.items())
        }
        return Imatrix(entries, datasets, chunk_count, chunk_size)


def dense_positions(ctx: int, chunk: int, n_chunks: int) -> torch.Tensor | None:
    """The positions of chunk `chunk` (of `n_chunks`, `ctx` tokens each) whose dense
    products llama-imatrix collects (None: all). It decodes BATCH // ctx chunks at a time
    as that many sequences, whose ubatches take UBATCH // sequences tokens of each
    (llama.cpp's split_equal); a chunk past half a batch alone, in batches of up to BATCH
    tokens split into ubatches of UBATCH (split_simple). A ubatch of fewer than
    MIN_TOKENS tokens is left out."""
    keep = torch.ones(ctx, dtype=torch.bool)
    together = BATCH // ctx
    if together > 1:
        first = chunk - chunk % together
        sequences = min(together, n_chunks - first)
        step = max(1, UBATCH // sequences)
        for start in range(0, ctx, step):
            if sequences * min(step, ctx - start) < MIN_TOKENS:
                keep[start : start + step] = False
    else:
        for start in range(0, ctx, BATCH):
            size = min(BATCH, ctx - start)
            tail = size % UBATCH
            if 0 < tail < MIN_TOKENS:
                keep[start + size - tail : start + size] = False
    return None if bool(keep.all()) else keep


@torch.inference_mode()
def _chunk_logprobs(
    model: nn.Module, new_cache: NewCache, chunks: torch.Tensor, collector: Collector
) -> Iterator[torch.Tensor]:
    """Every token of each chunk through the model (in pieces of about PIECE through its
    cache, none of one token: one-token steps take fused paths that no hook sees),
    collecting; each chunk's log-probs at the positions perplexity scores."""
    count, ctx = chunks.shape
    first = ctx // 2
    bounds = [*range(0, ctx, PIECE), ctx]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    for i in range(count):
        cache = new_cache(1, ctx)
        ids = chunks[i : i + 1].to(cache.k.device)
        mask = dense_positions(ctx, i, count)
        kept = []
        for begin, end in itertools.pairwise(bounds):
            collector.dense = None if mask is None else mask[begin:end]
            positions = torch.arange(begin, end, device=ids.device)[None]
            logits = model(ids[:, begin:end], positions, cache)  # [1, end - begin, vocab]
            if end > first and begin < ctx - 1:
                scored = logits[0, max(first - begin, 0) : ctx - 1 - begin]
                kept.append(torch.log_softmax(scored.float(), dim=-1))
        collector.dense = None
        yield torch.cat(kept)


def collect(
    model: nn.Module, new_cache: NewCache, chunks: torch.Tensor, collector: Collector
) -> Iterator[Estimate]:
    """Run `model` over `chunks` (llmrun.perplexity.text_chunks) with `collector`'s
    hooks in place; the running perplexity after each chunk, as llama-imatrix prints it."""
    with collector:
        yield from estimates(_chunk_logprobs(model, new_cache, chunks, collector), chunks)


# ---- files ----


def write(imatrix: Imatrix, path: str | Path, output_format: str = "gguf") -> None:
    """Write `imatrix` as llama.cpp does, in its GGUF format or the legacy .dat, under a
    temporary name renamed at the end."""
    if output_format not in FORMATS:
        raise UsageError(f"unknown imatrix format {output_format!r}; choose from gguf, dat")
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        (_write_gguf if output_format == "gguf" else _write_dat)(imatrix, temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class _Writer(GGUFWriter):
    """GGUFWriter without the general.architecture it adds: an imatrix has none."""

    def add_architecture(self) -> None:
        pass


def _write_gguf(imatrix: Imatrix, path: Path) -> None:
    writer = _Writer(path, "")
    writer.add_string(KEY_TYPE, "imatrix")
    writer.add_array(KEY_DATASETS, list(imatrix.datasets))
    writer.add_uint32(KEY_CHUNK_COUNT, imatrix.chunk_count)
    writer.add_uint32(KEY_CHUNK_SIZE, imatrix.chunk_size)
    for name in sorted(imatrix.entries):
        e = imatrix.entries[name]
        # ggml writes the dimensions up to the last one over 1: a dense matrix's [columns]
        sums = e.sums if len(e.counts) > 1 else e.sums[0]
        counts = e.counts.astype(np.float32)[:, None] if len(e.counts) > 1 else e.counts[:1]
        writer.add_tensor(name + SUM_SUFFIX, np.ascontiguousarray(sums, np.float32))
        writer.add_tensor(name + COUNT_SUFFIX, np.ascontiguousarray(counts, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_dat(imatrix: Imatrix, path: Path) -> None:
    size = max(1, imatrix.chunk_size)
    stored = [(n, e) for n, e in sorted(imatrix.entries.items()) if e.counts.any()]
    parts = [struct.pack("<i", len(stored))]
    for name, e in stored:
        raw = name.encode()
        ncall = (int(e.counts.max()) + size - 1) // size
        counts = e.counts.astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            means = np.where(counts > 0, e.sums / counts, np.float32(1))
        values = (means.astype(np.float32) * np.float32(ncall)).astype("<f4")
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, values.size)]
        parts.append(values.tobytes())
    dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode()
    parts += [struct.pack("<ii", imatrix.chunk_count, len(dataset)), dataset]
    path.write_bytes(b"".join(parts))


def read(path: str | Path) -> Imatrix:
    """An imatrix file, GGUF or legacy .dat, checked as llama.cpp's loader checks it
    (and its sizes against the file's)."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such imatrix file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, not an imatrix file") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    imatrix = _read_gguf(path) if magic == gguf_io.GGUF_MAGIC else _read_dat(path)
    if not imatrix.entries:
        raise ModelFormatError(f"{path}: no importance matrix entries in the file")
    for name, e in imatrix.entries.items():
        if not np.isfinite(e.sums).all():
            raise ModelFormatError(f"{path}: entry {name!r} holds NaN or infinite values")
    return imatrix


def _read_gguf(path: Path) -> Imatrix:
    gg = gguf_io.read_gguf(path)
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in gg.metadata]
    if missing:
        raise ModelFormatError(
            f"{path}: missing imatrix metadata ({', '.join(missing)}): not an imatrix file"
        )
    datasets = gg.metadata[KEY_DATASETS]
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise ModelFormatError(f"{path}: {KEY_DATASETS} is not a list of strings")
    pairs: dict[str, dict[str, gguf_io.GGUFTensorInfo]] = {}
    for info in gg.tensors.values():
        for suffix in (SUM_SUFFIX, COUNT_SUFFIX):
            if info.name.endswith(suffix) and len(info.name) > len(suffix):
                pairs.setdefault(info.name.removesuffix(suffix), {})[suffix] = info
    entries = {}
    for name, pair in sorted(pairs.items()):
        if len(pair) != 2:
            raise ModelFormatError(f"{path}: mismatched sums and counts for {name!r}")
        sums_info, counts_info = pair[SUM_SUFFIX], pair[COUNT_SUFFIX]
        if {sums_info.ggml_type, counts_info.ggml_type} != {GGMLQuantizationType.F32}:
            raise ModelFormatError(f"{path}: sums and counts for {name!r} must be F32")
        sums, counts = (
            np.frombuffer(gg.buffer, np.float32, i.nbytes // 4, i.offset).copy()
            for i in (sums_info, counts_info)
        )
        if counts.size == 0 or sums.size % counts.size:
            raise ModelFormatError(
                f"{path}: {name!r} has {sums.size} sums for {counts.size} counts"
            )
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise ModelFormatError(f"{path}: the counts of {name!r} are not token counts")
        rounded = np.floor(counts.astype(np.float64) + 0.5).astype(np.int64)  # C's lround
        entries[name] = Entry(sums.reshape(counts.size, -1), rounded)
    return Imatrix(
        entries, list(datasets), int(gg.metadata[KEY_CHUNK_COUNT]), int(gg.metadata[KEY_CHUNK_SIZE])
    )


def _read_dat(path: Path) -> Imatrix:
    data = path.read_bytes()
    at = 0

    def take(n: int, what: str) -> bytes:
        nonlocal at
        if at + n > len(data):
            raise ModelFormatError(f"{path}: not an imatrix file (it ends inside {what})")
        at += n
        return data[at - n : at]

    def int32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    count = int32("the entry count")
    if count < 1:
        raise ModelFormatError(f"{path}: not an imatrix file (no entries)")
    entries = {}
    for i in range(count):
        length = int32(f"entry {i + 1}'s name")
        if length < 0:
            raise ModelFormatError(f"{path}: not an imatrix file (entry {i + 1}'s name)")
        try:
            name = take(length, f"entry {i + 1}'s name").decode()
        except UnicodeDecodeError:
            raise ModelFormatError(f"{path}: entry {i + 1}'s name is not UTF-8") from None
        ncall, nval = int32(f"{name!r}'s call count"), int32(f"{name!r}'s value count")
        if nval < 1:
            raise ModelFormatError(f"{path}: entry {name!r} has no values")
        values = np.frombuffer(take(4 * nval, f"{name!r}'s values"), "<f4").astype(np.float32)
        entries[name] = Entry(values[None], np.array([ncall], np.int64))
    chunk_count, datasets = 0, []
    if at < len(data):
        chunk_count = int32("the chunk count")
        if at < len(data):
            length = int32("the dataset name")
            if length > 0:
                datasets.append(take(length, "the dataset name").decode(errors="replace"))
    return Imatrix(entries, datasets, chunk_count, 0, legacy=True)


def quantize_metadata(imatrix: Imatrix, source: str) -> list[tuple[str, str | int]]:
    """The entries llama-quantize adds to a model it quantizes with `imatrix`, read from
    the file named `source`: its name and first dataset (127 bytes at most), the entry
    count and, where known, the chunk count."""

    def cut(text: str) -> str:
        return text.encode()[:127].decode(errors="ignore")

    entries: list[tuple[str, str | int]] = [("quantize.imatrix.file", cut(source))]
    if imatrix.datasets:
        entries.append(("quantize.imatrix.dataset", cut(imatrix.datasets[0])))
    entries.append(("quantize.imatrix.entries_count", len(imatrix.entries)))
    if imatrix.chunk_count > 0:
        entries.append(("quantize.imatrix.chunks_count", imatrix.chunk_count))
    return entries
