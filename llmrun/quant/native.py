"""Native CPU kernels (kernels.c, kernels_avx2.c): built with the C compiler at first
use, loaded with ctypes.

One of two kernel families is built, by the CPU's features: AVX-512 (kernels.c, with
-march=native) or, on CPUs without it (most AMD Zen 2/3, Intel desktop and laptop
CPUs), AVX2 with FMA and F16C (kernels_avx2.c, with -march=haswell). Both take the
same types and dequantize them exactly, and both have the packed layouts of Q4_0 and
Q5_0 (those of Q4_K and Q5_K only AVX-512: the AVX2 library's llmrun_block is 0 for
them).
The library goes into the cache folder, keyed by a hash of the source, the compiler,
its flags and the CPU's features, so later runs load it at once. LLMRUN_NATIVE=avx2
builds the AVX2 kernels on any CPU with AVX2 (to test them on an AVX-512 machine).
Where there is no compiler, the CPU has neither family, the build fails, or
LLMRUN_NATIVE=0 is set, `available()` is False and callers use the torch code.
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

# Kernel families, best first: their source, the -march flags they are built with
# (-march=haswell for AVX2, so that build never holds AVX-512 code even on an AVX-512
# CPU), and the /proc/cpuinfo flags the CPU must list.
NATIVE = Path(__file__).parents[1] / "native"
SOURCES = {"AVX-512": NATIVE / "kernels_avx512.c", "AVX2": NATIVE / "kernels_avx2.c"}
# Built into every family's library: the small f32 ops of a decode step (llmrun.ops).
DECODE_OPS = NATIVE / "decode_ops.c"
MARCH = {"AVX-512": ["-march=native"], "AVX2": ["-march=haswell", "-mtune=native"]}
NEEDS = {
    "AVX-512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c"},
    "AVX2": {"avx2", "fma", "f16c"},
}
# Types with a faster kernel on a repacked row layout (kernels.c: packed layouts; the
# AVX2 kernels read the same bytes, but for Q4_K and Q5_K), by the kernel's type id,
# and the byte sizes of their block fields in block order.
Q4_0, Q5_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0
Q4_K, Q5_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K
PACKED = {Q4_0: 1002, Q5_0: 1006, Q4_K: 1012, Q5_K: 1013}
FIELDS = {Q4_0: (2, 16), Q5_0: (2, 4, 16), Q4_K: (2, 2, 12, 128), Q5_K: (2, 2, 12, 32, 128)}
K_SCALE_GROUP = 16  # K-quant blocks whose scale fields `pack` interleaves (kernels.c: K_GROUP)
PACK_CHUNK = 1 << 22  # bytes of blocks `pack` repacks at a time
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp"]

_reason = ""
_family = ""  # the kernel family loaded, once _library() has found one


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _families() -> list[str]:
    """Kernel families to try on this CPU, best first; empty (with `_reason`) if none.

    Where the CPU's flags cannot be read (no /proc/cpuinfo, or not x86), AVX-512 is
    tried as before: its library reports llmrun_available() == 0 where it cannot run.
    """
    global _reason
    line = _cpu_features()
    features = set(line.split())
    forced = os.environ.get("LLMRUN_NATIVE", "1") == "avx2"
    if not line.startswith("flags"):
        return ["AVX2"] if forced else ["AVX-512"]
    found = [family for family, needs in NEEDS.items() if needs <= features]
    if forced:
        found = [family for family in found if family == "AVX2"]
    if not found:
        _reason = "this CPU lacks AVX2 (with FMA and F16C)" + ("" if forced else " and AVX-512")
    return found


def _flags(family: str) -> list[str]:
    return [*MARCH[family], *FLAGS]


def _build(compiler: str, family: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first runs never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_flags(family), str(SOURCES[family]), str(DECODE_OPS), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(compiler: str, family: str) -> ctypes.CDLL | None:
    """The built library of `family` (building it first if it is not cached), or None
    with `_reason` set."""
    global _reason
    source = SOURCES[family]
    key = hashlib.sha256(source.read_bytes() + DECODE_OPS.read_bytes())
    key.update(" ".join([family, compiler, *_flags(family), _cpu_features()]).encode())
    tag = family.lower().replace("-", "")
    target = paths.cache_dir().parent / "kernels" / f"llmrun-{tag}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, family, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        _reason = f"building {source.name} failed: {e.stderr.strip()[-500:]}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        _reason = f"building or loading {source.name} failed: {e}"
        return None
    if not lib.llmrun_available():
        _reason = f"this CPU lacks {family}"
        return None
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _reason, _family
    _family = ""
    if os.environ.get("LLMRUN_NATIVE", "1") == "0":
        _reason = "disabled by LLMRUN_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler found (set CC)"
        return None
    # The next family down where a build fails (say, a compiler without AVX-512).
    for family in _families():
        lib = _load(compiler, family)
        if lib is not None:
            break
    else:
        return None
    _family = family
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.llmrun_block.argtypes = [ctypes.c_int]
    lib.llmrun_matvec.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.llmrun_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
    f32 = ctypes.c_float
    lib.llmrun_rms_norm.argtypes = [ptr, ptr, f32, i64, i64, ptr]
    lib.llmrun_rotary.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.llmrun_silu_mul.argtypes = [ptr, ptr, i64, ptr]
    lib.llmrun_attend_one.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr]
    for fn in ("rms_norm", "rotary", "silu_mul", "attend_one"):
        getattr(lib, f"llmrun_{fn}").restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library (None without native kernels), for other modules' bindings."""
    return _library()


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


def _k_quants(qs: torch.Tensor, to_packed: bool) -> torch.Tensor:
    """Q4_K/Q5_K low quants `[rows, blocks, 128]`, GGML's order <-> kernels.c's packed order.

    GGML: byte 32p + l holds weight l of sub-block 2p (low nibble) and of 2p + 1 (high).
    Packed: byte 64h + 4i + s holds weights i (low) and 16 + i (high) of sub-block 4h + s.
    """
    rows, nb = qs.shape[:2]
    if to_packed:
        q = torch.stack([qs & 15, qs >> 4], 2)  # [.., 2 nibble, 128 byte]
        q = q.reshape(rows, nb, 2, 4, 32).transpose(2, 3)  # [.., p, nibble, l]: 32p + l
        q = q.reshape(rows, nb, 2, 4, 2, 16)  # sub-block 4h + s, weight 16t + i
        return (q[..., 0, :] | q[..., 1, :] << 4).transpose(3, 4).reshape(rows, nb, 128)
    b = qs.reshape(rows, nb, 2, 16, 4).transpose(3, 4)  # [.., h, s, i]
    q = torch.stack([b & 15, b >> 4], 4).reshape(rows, nb, 4, 2, 32)  # [.., p, nibble, l]
    return (q[..., 0, :] | q[..., 1, :] << 4).reshape(rows, nb, 128)


def _q5_k_high_bits(qh: torch.Tensor, to_packed: bool) -> torch.Tensor:
    """Q5_K high bits `[rows, blocks, 32]`, GGML's order <-> kernels.c's Q5_K_PACKED order.

    GGML: bit j of byte l is weight l of sub-block j. Packed: bit b of byte 4j + 2t + h
    (bit 8h + b of u16 mask 2j + t) is weight 16t + 8h + b of sub-block j.
    """
    rows, nb = qh.shape[:2]
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    if to_packed:
        bits = (qh[..., None] >> shifts) & 1  # [.., l = 16t + 8h + b, j]
        bits = bits.reshape(rows, nb, 2, 2, 8, 8).permute(0, 1, 5, 2, 3, 4)  # [.., j, t, h, b]
    else:
        bits = (qh.reshape(rows, nb, 8, 2, 2)[..., None] >> shifts) & 1  # [.., j, t, h, b]
        bits = bits.permute(0, 1, 3, 4, 5, 2)  # [.., t, h, b, j]
    return (bits << shifts).sum(-1, dtype=torch.uint8).reshape(rows, nb, 32)


def _k_scales(sc: torch.Tensor, to_packed: bool) -> torch.Tensor:
    """K-quant scale fields `[rows, blocks, 12]`, GGML's order <-> kernels.c's packed order.

    Packed: in groups of K_SCALE_GROUP blocks (the last group holds the c blocks left),
    a group of c blocks holding byte j of its block i at c * j + i.
    """
    rows, nb = sc.shape[:2]
    full = nb - nb % K_SCALE_GROUP  # blocks in whole groups
    if to_packed:
        groups = sc[:, :full].reshape(rows, -1, K_SCALE_GROUP, 12).transpose(2, 3)
        tail = sc[:, full:].transpose(1, 2)
    else:
        flat = sc.reshape(rows, 12 * nb)
        groups = flat[:, : 12 * full].reshape(rows, -1, 12, K_SCALE_GROUP).transpose(2, 3)
        tail = flat[:, 12 * full :].reshape(rows, 12, nb - full).transpose(1, 2)
    return torch.cat([groups.reshape(rows, full, 12), tail.reshape(rows, nb - full, 12)], 1)


def _reorder(
    fields: list[torch.Tensor], ggml_type: GGMLQuantizationType, to_packed: bool
) -> list[torch.Tensor]:
    """A block's fields `[rows, blocks, size]` with the K-quants' in-field orders
    changed to (or back from) the packed layout's; the other types' as they are."""
    if ggml_type in (Q4_K, Q5_K):
        fields[2] = _k_scales(fields[2], to_packed)
        fields[-1] = _k_quants(fields[-1], to_packed)
    if ggml_type == Q5_K:
        fields[3] = _q5_k_high_bits(fields[3], to_packed)
    return fields


def pack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """GGML blocks `[rows, row_bytes]` -> a new tensor in the packed layout: each row
    stored field by field (all its scales, then ..., then all its quants; same size;
    Q4_K's and Q5_K's scale fields also interleaved by groups of blocks and their
    quants, and Q5_K's high bits, reordered within each block)."""
    out = torch.empty_like(raw, memory_format=torch.contiguous_format)
    rows = max(1, PACK_CHUNK // max(1, raw.shape[1]))
    # By chunks of rows, so a large tensor (a tied embedding) has no whole-size temporaries.
    for r0 in range(0, raw.shape[0], rows):
        part = raw[r0 : r0 + rows]
        blocks = part.reshape(part.shape[0], -1, GGML_QUANT_SIZES[ggml_type][1])
        fields = _reorder(list(blocks.split(FIELDS[ggml_type], dim=2)), ggml_type, True)
        torch.cat([f.reshape(part.shape[0], -1) for f in fields], 1, out=out[r0 : r0 + rows])
    return out


def unpack(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The inverse of `pack`, in torch, so packed weights work on any device."""
    rows, nb = raw.shape[0], raw.shape[1] // GGML_QUANT_SIZES[ggml_type][1]
    fields = [f.reshape(rows, nb, -1) for f in raw.split([s * nb for s in FIELDS[ggml_type]], 1)]
    return torch.cat(_reorder(fields, ggml_type, False), 2).reshape(rows, -1)


def kernels() -> str | None:
    """The kernel family in use ("AVX-512" or "AVX2"), or None without native kernels."""
    return _family if available() else None


def status() -> str:
    """'native (AVX-512)', 'native (AVX2)' or why the torch fallback is in use, for
    stats lines and bug reports."""
    return f"native ({kernels()})" if available() else f"torch fallback: {_reason}"


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
