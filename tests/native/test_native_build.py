"""The native library (llmrun.native): the choice of kernel family, the cache, the
status line, and the fallback."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from llmrun import native, paths
from llmrun.native import build
from llmrun.quant import kernels

T = GGMLQuantizationType


def test_status_names_the_kernel_family(native_kernels: str):
    assert native.kernels() == native_kernels
    assert native.status() == f"native ({native_kernels})"
    # Each family is its own library in the cache, built from its own source.
    tag = {"AVX-512": "avx512", "AVX2": "avx2"}[native_kernels]
    assert Path(native._library()._name).name.startswith(f"llmrun-{tag}-")


def test_the_library_is_built_once_then_loaded_from_the_cache(native_kernels: str, monkeypatch):
    built = Path(native._library()._name)
    assert built.parent == paths.cache_dir().parent / "kernels"

    def no_build(*args):
        raise AssertionError("the cached library was built again")

    monkeypatch.setattr(build, "_compile", no_build)
    native._library.cache_clear()
    assert native.status() == f"native ({native_kernels})"
    assert Path(native._library()._name) == built


def test_processes_that_start_together_build_the_library_once(tmp_path):
    """Three processes loading a library the cache lacks: one builds it (its sources
    compiled side by side, then linked), the others wait for it and load it (each built
    it before: two test workers spent 46 and 49 s on the same library)."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "cc"
    # a compiler that logs each call and is slow enough for the processes to overlap
    compiler.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nsleep 1\nexec cc "$@"\n')
    compiler.chmod(0o755)
    sources = []
    for name, body in {"a": "int a(void) { return 2; }", "b": "int b(void) { return 3; }"}.items():
        (tmp_path / f"{name}.c").write_text(body + "\n")
        sources.append(str(tmp_path / f"{name}.c"))
    target = tmp_path / "lib" / "both.so"
    script = (
        "import sys, ctypes; from pathlib import Path; from llmrun.native import build; "
        f"build._compile({str(compiler)!r}, ['-O1', '-shared', '-fPIC'], "
        f"[Path(s) for s in {sources!r}], Path({str(target)!r})); "
        f"lib = ctypes.CDLL({str(target)!r}); print(lib.a() + lib.b())"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    assert [run.communicate(timeout=120)[0].strip() for run in runs] == ["5"] * 3
    lines = calls.read_text().splitlines()
    assert sorted(" -c " in f" {line} " for line in lines) == [False, True, True]
    assert sorted(p.name for p in target.parent.iterdir()) == ["both.so", "both.so.lock"]


@pytest.mark.parametrize("source", ["COMMON", "Q8_HEADER", "DECODE_OPS"])
def test_the_cache_key_covers_the_shared_sources(source: str, tmp_path, monkeypatch):
    before = build.target("cc", "AVX2")
    changed = tmp_path / "changed"
    changed.write_bytes(getattr(build, source).read_bytes() + b"\n")
    monkeypatch.setattr(build, source, changed)
    after = build.target("cc", "AVX2")
    assert after != before and after.parent == before.parent


AVX2_FLAGS = "flags\t\t: fpu sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_bf16"


@pytest.mark.parametrize(
    "flags, env, families, reason",
    [
        (AVX512_FLAGS, "1", ["AVX-512", "AVX2"], ""),
        (AVX2_FLAGS, "1", ["AVX2"], ""),
        (AVX512_FLAGS, "avx2", ["AVX2"], ""),
        ("flags\t\t: fpu sse2 avx", "1", [], "lacks AVX2 (with FMA and F16C) and AVX-512"),
        ("flags\t\t: fpu sse2 avx", "avx2", [], "lacks AVX2 (with FMA and F16C)"),
        ("", "1", ["AVX-512"], ""),  # no flags to read: its build decides, as before
    ],
)
def test_the_kernel_family_follows_the_cpu(flags, env, families, reason, monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: flags)
    found, why = build.candidates(env)
    assert found == families
    assert reason in why and bool(reason) == bool(why)


def test_another_family_is_one_more_entry_in_the_table(monkeypatch):
    neon = build.Family("kernels_neon.c", ("-march=armv8-a",), frozenset({"asimd"}), "NEON")
    monkeypatch.setitem(build.FAMILIES, "NEON", neon)
    monkeypatch.setattr(build, "cpu_features", lambda: "Features\t: fp asimd evtstrm crc32")
    assert build.candidates("1") == (["NEON"], "")
    assert build.candidates("neon") == (["NEON"], "")
    found, why = build.candidates("avx2")
    assert found == [] and why == "this CPU lacks AVX2 (with FMA and F16C)"


def test_a_cpu_without_avx512_gets_the_avx2_kernels(fresh_native, monkeypatch):
    if not build.FAMILIES["AVX2"].needs <= set(build.cpu_features().split()):
        pytest.skip("this CPU lacks AVX2")
    # As if AVX-512 needed a flag no CPU has; the CPU's flags (the cache key) stay.
    avx512 = dataclasses.replace(
        build.FAMILIES["AVX-512"], needs=frozenset({"avx512f", "no-such-flag"})
    )
    monkeypatch.setitem(build.FAMILIES, "AVX-512", avx512)
    monkeypatch.delenv("LLMRUN_NATIVE", raising=False)
    assert native.status() == "native (AVX2)"
    assert kernels.supports(T.Q4_K, 256) and kernels.supports(T.Q4_0, 256, packed=True)


@pytest.mark.parametrize(
    "env, reason", [({"LLMRUN_NATIVE": "0"}, "LLMRUN_NATIVE=0"), ({"CC": "/nonexistent/cc"}, "")]
)
def test_without_kernels_the_status_says_why(env: dict, reason: str, fresh_native, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not native.available() and native.kernels() is None
    assert not kernels.supports(T.Q4_0, 32)
    assert native.status().startswith("torch fallback: ") and reason in native.status()
