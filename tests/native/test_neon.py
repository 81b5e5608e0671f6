"""The NEON kernel family (kernels_neon.c) on machines that cannot run it: built for
aarch64 with its flags by a cross compiler, linked with a small C driver
(neon/driver.c) that checks it against test vectors from gguf's reference
(neon/vectors.py), and run under qemu-user. .ci/run installs both tools (Debian:
gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user); without them the test skips."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from neon import vectors

from llmrun.native import build

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
DRIVER = Path(__file__).parent / "neon" / "driver.c"
# The oldest core the family is for (ARMv8.0: Raspberry Pi 4, Graviton 1), so no newer
# instruction slips into the build.
QEMU_CPU = "cortex-a72"

GRAVITON2 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
RASPBERRY_PI_4 = "Features\t: fp asimd evtstrm crc32 cpuid"


@pytest.mark.parametrize("line", [GRAVITON2, RASPBERRY_PI_4])
def test_an_arm_cpu_gets_the_neon_kernels(line: str, monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: line)
    assert build.candidates("1") == (["NEON"], "")
    assert build.candidates("neon") == (["NEON"], "")


def test_an_x86_cpu_without_avx2_hears_only_of_the_x86_families(monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: "flags\t\t: fpu sse2 avx")
    found, why = build.candidates("1")
    assert found == [] and why == "this CPU lacks AVX2 (with FMA and F16C) and AVX-512"
    assert build.candidates("neon") == ([], "this CPU lacks NEON")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, str]:
    """Each case's name -> "" if it passed under qemu, else why not."""
    if shutil.which(CROSS_CC) is None or QEMU is None:
        tools = [(CROSS_CC, shutil.which(CROSS_CC)), ("qemu-aarch64", QEMU)]
        missing = " and ".join(name for name, path in tools if path is None)
        pytest.skip(f"no {missing} to build and run the NEON kernels (.ci/run installs them)")
    folder = tmp_path_factory.mktemp("neon")
    names = vectors.write(folder)
    driver = folder / "driver"
    family = build.FAMILIES["NEON"]
    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC")]
    sources = [build.HERE / family.source, build.DECODE_OPS, DRIVER]
    command = [CROSS_CC, *family.march, *flags, "-static", "-Wall", "-Wextra", "-Werror"]
    command += [f"-I{build.HERE}", *map(str, sources), "-lm", "-o", str(driver)]
    compiled = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr
    run = subprocess.run(
        [QEMU, "-cpu", QEMU_CPU, str(driver), str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},  # the kernels' threaded passes too
    )
    assert run.returncode in (0, 1), run.stdout + run.stderr
    found = {}
    for line in run.stdout.splitlines():  # "ok KIND NAME" or "FAIL KIND NAME: why"
        head, _, why = line.partition(": ")
        verdict, _, name = head.split()
        found[name] = "" if verdict == "ok" else why
    assert sorted(found) == sorted(names), run.stdout + run.stderr
    return found


@pytest.mark.parametrize("group", vectors.GROUPS)
def test_neon_kernels_under_qemu(group: str, results: dict[str, str]):
    cases = {name: why for name, why in results.items() if name.split("/")[0] == group}
    assert cases and {name: why for name, why in cases.items() if why} == {}
