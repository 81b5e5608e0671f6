"""Weight memory in transparent huge pages (llmrun.quant.hugepages)."""

from pathlib import Path

import pytest
import torch

from llmrun.quant import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kb_of(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    address, kb, inside = t.data_ptr(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            kb = int(line.split()[1])
    return kb


def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_is_copied():
    source = torch.arange(5 * hugepages.HUGE_PAGE // 4, dtype=torch.int32)  # 5 MB
    t = hugepages.copy(source)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert t.is_contiguous() and t.shape == source.shape and t.dtype == source.dtype
    assert torch.equal(t, source)


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_its_whole_pages_are_huge_where_the_kernel_allows():
    t = hugepages.copy(torch.ones(3 * hugepages.HUGE_PAGE, dtype=torch.uint8))
    assert huge_kb_of(t) >= 2048 * 2  # two whole pages; the tail stays small


def test_a_small_tensor_is_an_ordinary_one():
    t = hugepages.empty((16, 16), torch.float32)
    assert t.shape == (16, 16) and t.dtype == torch.float32
