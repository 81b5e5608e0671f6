"""Native CPU kernels (kernels.c): built with the C compiler at first use, loaded with ctypes.

The library is compiled for this CPU (-march=native) into the cache folder, keyed
by a hash of the source, the compiler and the CPU's features, so later runs load
it at once. Where there is no compiler, the CPU lacks AVX-512, the build fails,
or LLMRUN_NATIVE=0 is set, `available()` is False and callers use the torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmrun import paths

SOURCE = Path(__file__).with_name("kernels.c")
# Types with a faster kernel on a repacked row layout (kernels.c: packed layouts), by
# the kernel's type id, and the byte sizes of their block fields in block order.
PACKED = {GGMLQuantizationType.Q4_0: 1002, GGMLQuantizationType.Q5_0: 1006}
FIELDS = {GGMLQuantizationType.Q4_0: (2, 16), GGMLQuantizationType.Q5_0: (2, 4, 16)}
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp"]

_reason = ""


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first runs never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason
    if os.environ.get("LLMRUN_NATIVE", "1") == "0":
        _reason = "disabled by LLMRUN_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler found (set CC)"
        return None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), " ".join(FLAGS).encode()):
        key.update(part)
    key.update(_cpu_features().encode())
    target = paths.cache_dir().parent / "kernels" / f"llmrun-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        _reason = f"building {SOURCE.name} failed: {e.stderr.strip()[-500:]}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        _reason = f"building or loading {SOURCE.name} failed: {e}"
        return None
    if not lib.llmrun_available():
        _reason = "this CPU lacks AVX-512"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.llmrun_block.argtypes = [ctypes.c_int]
    lib.llmrun_matvec.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.llmrun_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    return lib


def available() -> bool:
    """Whether the native kernels are built and usable on this machine."""
    return _library() is not None


@functools.cache
def supports(ggml_type: GGMLQuantizationType, n_cols: int, packed: bool = False) -> bool:
    """Whether the native kernels take rows of `n_cols` weights of `ggml_type`
    (in the packed layout, if `packed`)."""
    lib = _library()
    if lib is None or (packed and ggml_type not in PACKED):
        return False
    block = lib.llmrun_block(_kernel_type(ggml_type, packed))
    return block > 0 and n_cols % block == 0


def _kernel_type(ggml_type: GGMLQuantizationType, packed: bool) -> int:
    return PACKED[ggml_type] if packed else int(ggml_type)


def pack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """GGML blocks `[rows, row_bytes]` -> a new tensor in the packed layout: each row
    stored field by field (all its scales, then ..., then all its quants; same size)."""
    blocks = raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[ggml_type][1])
    fields = blocks.split(FIELDS[ggml_type], dim=2)
    return torch.cat([f.reshape(raw.shape[0], -1) for f in fields], 1)


def unpack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The inverse of `pack`, in torch, so packed weights work on any device."""
    rows, nb = raw.shape[0], raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1]
    fields = raw.split([size * nb for size in FIELDS[ggml_type]], dim=1)
    return torch.cat([f.reshape(rows, nb, -1) for f in fields], 2).reshape(rows, -1)


def status() -> str:
    """'native' or why the torch fallback is in use, for stats lines and bug reports."""
    return "native" if available() else f"torch fallback: {_reason}"


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
) -> torch.Tensor:
    """x f32 `[m, n]` times the blocks `[rows, row_bytes]` transposed (+ f32 `bias`
    `[rows]`) -> f32 `[m, rows]`."""
    n = _n_cols(raw, ggml_type, packed)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[1] != n:
        raise ValueError(f"activations must be f32 [m, {n}], got {x.dtype} {list(x.shape)}")
    return Matvec(raw, ggml_type, packed, bias)(x)


class Matvec:
    """A bound `matvec` for one weight tensor (and its bias): its checks and arguments
    worked out once, so a decode step pays only for the call (one per linear layer
    per token)."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        packed: bool = False,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.n = _n_cols(raw, ggml_type, packed)
        self.rows = raw.shape[0]
        if bias is not None and (
            bias.dtype != torch.float32 or bias.device != raw.device or bias.shape != (self.rows,)
            or not bias.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"the bias must be f32 [{self.rows}] on the weight's device")
        self.kept = (raw, bias)  # keeps the memory the pointers below point into alive
        self.args = (_kernel_type(ggml_type, packed), raw.data_ptr(), raw.stride(0), self.rows)
        self.bias = None if bias is None else bias.data_ptr()
        self.fn = _library().llmrun_matvec

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x f32 `[m, n]` (contiguous) -> f32 `[m, rows]`."""
        m = x.numel() // self.n
        y = torch.empty(m, self.rows, dtype=torch.float32)
        self.fn(*self.args, x.data_ptr(), m, self.n, y.data_ptr(), self.bias)
        return y


def dequantize(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, packed: bool = False
) -> torch.Tensor:
    """Blocks `[rows, row_bytes]` -> f32 `[rows, n]`, bit-exact with blocks.dequantize."""
    n = _n_cols(raw, ggml_type, packed)
    out = torch.empty(raw.shape[0], n, dtype=torch.float32)
    _library().llmrun_dequantize(
        _kernel_type(ggml_type, packed),
        raw.data_ptr(),
        raw.stride(0),
        raw.shape[0],
        n,
        out.data_ptr(),
    )
    return out
