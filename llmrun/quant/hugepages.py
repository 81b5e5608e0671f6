"""Weight memory in transparent huge pages (Linux), for the tensors a decode step reads
whole every token.

A matvec streams its weights once per token, and in 4 KB pages that is a TLB miss
every 4 KB; the CPU's prefetchers also stop at page edges. In 2 MB pages (where the
kernel's transparent_hugepage setting is `madvise` or `always`) the native matvecs
read 15-20 % faster from memory (benchmarks/README.md: measured on Zen 4). torch's
allocator does not ask for them, so weights that are copied or repacked at load go
into an anonymous map of their own whose 2 MB-aligned whole pages are advised
MADV_HUGEPAGE; the tail stays in small pages, so no huge page is faulted in for a few
bytes. Elsewhere (no MADV_HUGEPAGE, or a small tensor) it is an ordinary tensor.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
# Smaller tensors gain nothing worth a map of their own.
MIN_BYTES = HUGE_PAGE


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor, its whole 2 MB pages advised huge."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advise is None:
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the map alive
    start = -base.data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        buffer.madvise(advise, start, whole)
    except OSError:  # a kernel without transparent huge pages: small pages, as before
        pass
    return base[start : start + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """t (on CPU) copied into empty()'s memory."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
