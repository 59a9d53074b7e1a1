"""runtime/huge_pages.py: zeroed tensors on 2 MiB pages where the host allows it, plain zeros
elsewhere; and the KV stores that use it (runtime/kv_cache.py)."""
from __future__ import annotations

import pytest
import torch

from runtime import huge_pages


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings of /proc/self/smaps that hold ``t``'s data."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


needs_thp = pytest.mark.skipif(huge_pages.thp_mode() not in ("madvise", "always"),
                               reason=f"transparent huge pages are {huge_pages.thp_mode()!r} on this host")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_store_lands_on_huge_pages_zeroed_and_aligned(dtype):
    shape = (1, 3, 16640, 64)  # SmolLM2's store at 16K: 6.4 MB in bfloat16, 3.2 MB in int8
    before = huge_pages.advised_bytes()
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert huge_pages.advised_bytes() > before
    assert torch.count_nonzero(t) == 0
    # the kernel backed it with 2 MiB pages: at least one whole page of the data
    assert _huge_kib(t) >= huge_pages.HUGE_PAGE_BYTES // 1024
    # writes reach the tensor as to any other
    t[0, 1, 5, 3] = 7
    assert t.sum().item() == 7


def test_small_tensors_and_other_devices_get_plain_zeros():
    before = huge_pages.advised_bytes()
    t = huge_pages.zeros((3, 64), torch.float32)
    assert torch.equal(t, torch.zeros(3, 64)) and huge_pages.advised_bytes() == before
    meta = huge_pages.zeros((1, 3, 8320, 64), torch.float32, device="meta")
    assert meta.device.type == "meta" and huge_pages.advised_bytes() == before


def test_without_thp_it_is_torch_zeros(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    before = huge_pages.advised_bytes()
    t = huge_pages.zeros((1, 3, 8320, 64), torch.float32)
    assert huge_pages.advised_bytes() == before
    assert torch.count_nonzero(t) == 0 and t.shape == (1, 3, 8320, 64)


def test_a_refused_madvise_falls_back(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "_madvise", lambda: (lambda *a: -1))
    before = huge_pages.advised_bytes()
    t = huge_pages.zeros((1, 3, 8320, 64), torch.float32)
    assert huge_pages.advised_bytes() == before and torch.count_nonzero(t) == 0
