"""Build one kernel family's library with the C compiler, cache it, and load it with ctypes.

A family is one C file of quantized kernels in this folder (with common.h), and on x86
one of 8-bit-activation kernels (with q8.h), compiled with its -march flags together
with decode_ops.c, decode_step.c, layout.c, quantize.c and quantize_iq.c into one shared
library. The table below names each, best first, with the features the CPU must list in
/proc/cpuinfo: a new family is one more source and one more entry. The library goes into
the cache folder, keyed by a hash of the sources, the compiler, its flags and the
CPU's features, so later runs load it at once.

The tokenizer's merging (tokenize.c, llmrun.gguf_bpe) is a library of its own, built
without -march flags: it holds no kernels and builds in a moment.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no build lock
    fcntl = None

from llmrun import paths

HERE = Path(__file__).parent
# Built into every family's library: the small f32 ops of a decode step (llmrun.ops), and
# the whole step of a stack of decoder layers in one call (llmrun.quant.decode_step).
DECODE_OPS = HERE / "decode_ops.c"
DECODE_STEP = HERE / "decode_step.c"
LAYOUT = HERE / "layout.c"  # the packed row layouts, written at load (kernels.pack)
QUANTIZE = HERE / "quantize.c"  # f32 rows -> GGML blocks, as ggml's reference (llmrun quantize)
QUANTIZE_IQ = HERE / "quantize_iq.c"  # f32 rows -> i-quant and ternary blocks, as ggml's
TOKENIZE = HERE / "tokenize.c"
TOKENIZE_FLAGS = ["-O2", "-shared", "-fPIC"]
COMMON = HERE / "common.h"
Q8_HEADER = HERE / "q8.h"  # the 8-bit-activation kernels' shared part
IQUANTS = HERE / "iquants.h"  # the x86 families' i-quant dequantizers
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp"]
FEATURE_LINES = ("flags", "Features")  # where /proc/cpuinfo lists them, on x86 and on ARM


@dataclass(frozen=True)
class Family:
    source: str  # the kernels' C file, in this folder
    march: tuple[str, ...]  # the -march flags it is built with
    needs: frozenset[str]  # the features the CPU's /proc/cpuinfo must list
    lacking: str  # how "this CPU lacks ..." names it
    line: str = "flags"  # the /proc/cpuinfo line that lists them: x86's flags, ARM's Features
    q8: str | None = None  # its 8-bit-activation kernels' C file, if it has them
    gemm: str | None = None  # its f32 GEMM for a prompt's rows, if it has one (else torch's)

    def sources(self) -> list[Path]:
        extra = [HERE / name for name in (self.q8, self.gemm) if name]
        return [HERE / self.source, *extra, DECODE_OPS, DECODE_STEP, LAYOUT, QUANTIZE, QUANTIZE_IQ]


# -march=haswell for AVX2, so that build never holds AVX-512 code even on an AVX-512 CPU.
FAMILIES = {
    "AVX-512": Family(
        "kernels_avx512.c",
        ("-march=native",),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c"}),
        "AVX-512",
        q8="q8_avx512.c",
    ),
    "AVX2": Family(
        "kernels_avx2.c",
        ("-march=haswell", "-mtune=native"),
        frozenset({"avx2", "fma", "f16c"}),
        "AVX2 (with FMA and F16C)",
        q8="q8_avx2.c",
        gemm="gemm_avx2.c",
    ),
    # Every 64-bit ARM CPU (Graviton, Ampere, Raspberry Pi 3 to 5, Apple Silicon under
    # Linux) has NEON ("asimd"); the kernels need nothing newer (kernels_neon.c says why
    # not dotprod). No -mtune=native: tests/native/test_neon.py builds with these flags
    # on a cross compiler, which has no native CPU. Tested under qemu, speed unmeasured.
    "NEON": Family(
        "kernels_neon.c", ("-march=armv8-a",), frozenset({"fp", "asimd"}), "NEON", "Features"
    ),
}


class BuildError(Exception):
    """A family's library could not be built or loaded here; the message says why."""


def _tag(family: str) -> str:
    """The family's short name, in its library's file name and for LLMRUN_NATIVE."""
    return family.lower().replace("-", "")


def cpu_features() -> str:
    """The CPU's feature line of /proc/cpuinfo (x86: `flags`, ARM: `Features`), else
    what `platform` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(FEATURE_LINES)), "")
    except OSError:
        return platform.processor()


def candidates(setting: str) -> tuple[list[str], str]:
    """The families to try on this CPU, best first, and if none, why.

    `setting` is LLMRUN_NATIVE: a family's tag (`avx2`) leaves that family alone, to
    test it on a CPU that has a better one. Where the CPU's features cannot be read
    (no /proc/cpuinfo), the first family is tried: its library reports
    llmrun_available() == 0 where it cannot run.
    """
    forced = [family for family in FAMILIES if _tag(family) == setting]
    tried = forced or list(FAMILIES)
    line = cpu_features()
    if not line.startswith(FEATURE_LINES):
        return tried[:1], ""
    features = set(line.split())
    found = [family for family in tried if FAMILIES[family].needs <= features]
    # Only families of this CPU's kind (by its feature line) are worth naming as lacking,
    # unless the one asked for is of another kind.
    kind = [family for family in tried if line.startswith(FAMILIES[family].line)] or tried
    lacking = " and ".join(FAMILIES[family].lacking for family in reversed(kind))
    return found, "" if found else f"this CPU lacks {lacking}"


def _flags(family: str) -> list[str]:
    return [*FAMILIES[family].march, *FLAGS]


def _compile(compiler: str, flags: list[str], sources: list[Path], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One build of a library at a time: a process that starts while another builds it
    # (a second test worker, a server started beside a run) waits, then finds it built.
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        # Built beside the target and renamed, so a process never loads half a file.
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            if len(sources) == 1:
                _run([compiler, *flags, str(sources[0]), "-o", str(built)])
            else:
                objects = _objects(compiler, flags, sources, Path(tmp))
                _run([compiler, *flags, *map(str, objects), "-o", str(built)])
            os.replace(built, path)


def _objects(compiler: str, flags: list[str], sources: list[Path], tmp: Path) -> list[Path]:
    """Each source compiled to an object file in tmp, as many at once as this process
    has cores (the AVX2 family's library took 45 s as one compiler run on a 2-core Zen 3)."""
    objects = [tmp / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
    commands = [
        [compiler, *flags, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(sources, objects, strict=True)
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with concurrent.futures.ThreadPoolExecutor(cores or 1) as pool:
        list(pool.map(_run, commands))  # raises the first failure
    return objects


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)


def target(compiler: str, family: str) -> Path:
    """Where the cache keeps `family`'s library as `compiler` builds it for this CPU."""
    sources = (*FAMILIES[family].sources(), COMMON, Q8_HEADER, IQUANTS)
    return _cached(_tag(family), sources, [family, compiler, *_flags(family), cpu_features()])


def _cached(name: str, sources: tuple[Path, ...], settings: list[str]) -> Path:
    key = hashlib.sha256()
    for path in sources:
        key.update(path.read_bytes())
    key.update(" ".join(settings).encode())
    return paths.cache_dir().parent / "kernels" / f"llmrun-{name}-{key.hexdigest()[:16]}.so"


def load_tokenize(compiler: str) -> ctypes.CDLL:
    """The tokenizer's library (tokenize.c), built first if the cache lacks it; BuildError
    if it cannot be built or loaded."""
    path = _cached("tokenize", (TOKENIZE,), [compiler, *TOKENIZE_FLAGS])
    try:
        if not path.exists():
            _compile(compiler, TOKENIZE_FLAGS, [TOKENIZE], path)
        return ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        raise BuildError(f"building tokenize.c failed: {e.stderr.strip()[-500:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"building or loading tokenize.c failed: {e}") from e


def load(compiler: str, family: str) -> ctypes.CDLL:
    """`family`'s library, built first if the cache lacks it; BuildError if it cannot
    be built or loaded, or cannot run on this CPU."""
    source = FAMILIES[family].source
    path = target(compiler, family)
    try:
        if not path.exists():
            _compile(compiler, _flags(family), FAMILIES[family].sources(), path)
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        raise BuildError(f"building {source} failed: {e.stderr.strip()[-500:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"building or loading {source} failed: {e}") from e
    if not lib.llmrun_available():
        raise BuildError(f"this CPU lacks {family}")
    return lib
