"""How many threads to compute with when the user does not say: the cores that are free.

A team of OpenMP threads waits for its slowest member at every kernel call, and a decode
step makes a few hundred of them; when another process holds one of two cores, a
two-thread team runs at the speed of the thread that keeps losing its core (measured:
decode falls to a third). So the default is the cores this process may use
(sched_getaffinity) less the cores other processes kept busy since this module was
imported, read from /proc/stat with this process's own CPU time taken out. The first
reading is taken at import, so the interval costs nothing: it spans the start-up. Where
/proc/stat is missing (macOS, Windows) every usable core counts as free.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_MIN_INTERVAL = 0.05  # seconds; a shorter window says little about the other processes


@dataclass(frozen=True)
class CpuSample:
    busy: float  # seconds of CPU time all processes have used, machine-wide
    own: float  # seconds of CPU time this process has used
    at: float  # monotonic clock


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # guest time is already counted in user time
    busy = sum(ticks[:8]) - idle
    return busy / os.sysconf("SC_CLK_TCK")


def sample() -> CpuSample | None:
    """A reading of the machine's and this process's CPU time, or None without /proc."""
    busy = _machine_busy_seconds()
    if busy is None:
        return None
    times = os.times()
    return CpuSample(busy, times.user + times.system, time.monotonic())


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores(start: CpuSample | None, end: CpuSample | None, usable: int) -> int:
    """The usable cores that other processes left free between two readings, at least 1."""
    if start is None or end is None or end.at - start.at <= 0:
        return usable
    others = (end.busy - start.busy) - (end.own - start.own)
    busy_cores = max(0.0, others / (end.at - start.at))
    # A core counts as taken when another process kept it more than half busy.
    return max(1, min(usable, usable - int(busy_cores + 0.5)))


_START = sample()


def default_threads() -> int:
    """Threads for the CPU kernels when the user gives none: the usable cores left free."""
    if _START is not None:
        wait = _MIN_INTERVAL - (time.monotonic() - _START.at)
        if wait > 0:
            time.sleep(wait)
    return free_cores(_START, sample(), usable_cores())
