"""The default thread count: the usable cores that other processes leave free."""

import json
import os
import subprocess
import sys

import pytest

from llmrun.threads import CpuSample, free_cores, sample, usable_cores


def test_free_cores_takes_out_this_process_and_rounds_to_whole_cores():
    start = CpuSample(busy=100.0, own=10.0, at=0.0)
    # Over one second: 1.9 core-seconds used machine-wide, 0.9 of them by this process.
    assert free_cores(start, CpuSample(101.9, 10.9, 1.0), usable=2) == 1
    assert free_cores(start, CpuSample(100.9, 10.9, 1.0), usable=2) == 2  # only us
    assert free_cores(start, CpuSample(100.4, 10.0, 1.0), usable=2) == 2  # a light load
    assert free_cores(start, CpuSample(103.0, 10.0, 1.0), usable=4) == 1
    assert free_cores(start, CpuSample(108.0, 10.0, 1.0), usable=4) == 1  # never below 1
    assert free_cores(None, None, usable=3) == 3  # no /proc/stat: every core counts


def test_a_reading_of_this_machine():
    reading = sample()
    if reading is None:
        pytest.skip("no /proc/stat here")
    assert reading.busy > 0 and reading.own > 0
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


@pytest.mark.skipif(sample() is None, reason="no /proc/stat here")
@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_a_busy_core_is_left_to_its_process():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmrun",
                "bench",
                "-p",
                "0",
                "-n",
                "2",
                "-r",
                "1",
                "-o",
                "json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        hog.kill()
        hog.wait()
    assert r.returncode == 0, r.stderr
    (record,) = json.loads(r.stdout)
    assert record["threads"] <= usable_cores() - 1
