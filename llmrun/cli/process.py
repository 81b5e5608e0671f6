"""Process-wide settings the command line makes before a command runs: how often
Python's cyclic GC looks, and how glibc's malloc keeps freed memory.

Only the command line makes them: a program that imports llmrun keeps its own.
"""

from __future__ import annotations

import ctypes
import gc
import os

from llmrun import heap

GC_THRESHOLD = 50_000  # allocations between looks at the young objects (Python's: 700)
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def tune() -> None:
    """Set both, before any command runs (the model commands are the ones they help)."""
    # Python's cyclic GC looks at the young objects every 700 allocations, and every few
    # hundred looks walk all of them: ~0.3 s of the ~200k objects torch's import makes, of
    # a 4 s `run` (2-core Zen 3). Every 50,000 it is ~0.1 s; a server's or a chat's
    # cycles are still collected.
    gc.set_threshold(GC_THRESHOLD)
    tune_malloc()


def tune_malloc() -> bool:
    """Keep a prompt's temporaries (GEMM tiles of up to 16 MB, activations) for reuse.

    With glibc's defaults, a 512-token prompt on the Qwen2.5-0.5B-shaped files
    page-faulted ~200k fresh pages in some processes (0.4-0.7 s of kernel time of a
    2-4 s prefill, 2-core Zen 3): blocks mapped and unmapped one by one, or the heap's
    top handed back and taken again. Fixed thresholds keep them, up to the most the
    process has held. False where the C library is not glibc (nothing is changed)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        libc = ctypes.CDLL("libc.so.6")
    except (ValueError, OSError, AttributeError):
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD)
        and libc.mallopt(_M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD)
    )
