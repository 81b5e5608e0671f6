"""Shared test setup. Its presence puts tests/ on sys.path, so test modules in
subfolders can `import helpers`; it adds tests/models after it, whose checks the shared
family_checks reuses (test_paged, test_static_decode, test_cache_types), so a helper that
imports family_checks works however the tests are chosen.

- Tests run torch on one thread (subprocesses inherit it): the test models are
  tiny, and on a busy 2-core machine two OpenMP threads per process spin against
  each other and run ten times slower.
- The cyclic GC looks at young objects every 50,000 allocations, as the command line
  sets it (Python's 700 had each worker walk its million objects every few seconds).
- Everything llmrun writes (model cache, REPL history, built kernels) goes to a
  temporary LLMRUN_HOME for the session, never to the user's own folders.
- `native_kernels` runs a test against each native kernel family this CPU has:
  AVX-512 (kernels_avx512.c, the default where the CPU has it) and AVX2
  (kernels_avx2.c, forced with LLMRUN_NATIVE=avx2, so an AVX-512 machine tests both).
- LLMRUN_TEST_KERNELS=DIR (opt-in, for development) keeps the built kernels in DIR
  across sessions instead of rebuilding them in each fresh LLMRUN_HOME (tens of
  seconds per run on 2 cores). Safe to share: a library's name hashes its sources,
  flags and the CPU's features, and each is built beside its name and renamed.
"""

import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).parent / "models"))

# The shared checks' asserts explain their failures as a test module's do.
pytest.register_assert_rewrite("image_serving", "family_checks", "hybrid_checks", "vision_checks")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# As the command line collects (llmrun.cli.process): with the default, each test
# worker's cyclic GC walked its million objects (torch, transformers) every few seconds;
# the suite's CPU time fell by about a quarter without it. The number, not
# llmrun.cli.process's GC_THRESHOLD: importing llmrun.cli here would import gguf without
# mistral_common for the whole worker (llmrun.cli.preload), and test_tekken needs gguf's
# MistralVocab.
gc.set_threshold(50_000)
if "LLMRUN_HOME" not in os.environ:
    _home = tempfile.mkdtemp(prefix="llmrun-tests-")
    os.environ["LLMRUN_HOME"] = _home
    atexit.register(shutil.rmtree, _home, ignore_errors=True)
    if os.environ.get("LLMRUN_TEST_KERNELS"):
        os.makedirs(os.environ["LLMRUN_TEST_KERNELS"], exist_ok=True)
        os.symlink(
            os.path.abspath(os.environ["LLMRUN_TEST_KERNELS"]), os.path.join(_home, "kernels")
        )

from llmrun import native  # noqa: E402  (after LLMRUN_HOME is set)
from llmrun.quant import kernels  # noqa: E402

FAMILIES = ["AVX-512", "AVX2"]


def pytest_collection_finish(session) -> None:
    """What collection imported (torch, transformers, every test module: ~700,000
    objects) lives until the end: frozen, no full collection walks it again. Each of
    those (the tests' gc.collect, pytest's five at the end) took ~0.8 s a worker."""
    gc.collect()
    gc.freeze()


def _reset() -> None:
    native._library.cache_clear()
    kernels.supports.cache_clear()
    kernels.supports_q8.cache_clear()


@pytest.fixture
def fresh_native(monkeypatch):
    """The native caches (the library, kernels.supports) cleared before and after the
    test; the test's monkeypatching is undone before the second clear, so later tests
    find the default kernels again."""
    _reset()
    yield
    monkeypatch.undo()
    _reset()


@pytest.fixture
def use_kernels(fresh_native, monkeypatch):
    """A function that switches native to a kernel family, or skips the test where this
    CPU (or LLMRUN_NATIVE=0) leaves that family out."""

    def use(family: str) -> None:
        if family == "AVX2" and os.environ.get("LLMRUN_NATIVE") != "0":
            monkeypatch.setenv("LLMRUN_NATIVE", "avx2")
        _reset()
        if native.kernels() != family:
            pytest.skip(f"no {family} kernels: {native.status()}")

    return use


@pytest.fixture(params=FAMILIES)
def native_kernels(request, use_kernels) -> str:
    """Run a test with each native kernel family; the family's name."""
    use_kernels(request.param)
    return request.param
