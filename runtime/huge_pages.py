"""Host tensors on transparent huge pages (2 MiB), for the stores our CPU kernels read at scattered rows.

Why (issue 51): the refine kernel reads, per layer and step, about 9,000 scattered key rows and
3,000 value rows of the KV stores (128 bytes each in bfloat16), nearly every one on a different
4 KiB page: the data TLB misses on most of them. On 2 MiB pages a layer's stores span a few
entries. Measured on the Intel Xeon (model 167, 2 cores) with the kernel's standalone driver
(``benchmarks/refine_kernel_driver.cpp``, ``HUGE=1``): a 30-layer step of the refine kernel
6.6 -> 5.3 ms (bfloat16 stores), 9.8 -> 7.8 ms (float32), stores read from memory
(docs/benchmarks.md, "Huge pages for the stores").

How: Linux's transparent huge pages in ``madvise`` mode (the default of many distributions)
back only the memory that asks for them. :func:`zeros` allocates a byte buffer with room to
start its data on a 2 MiB boundary, calls ``madvise(MADV_HUGEPAGE)`` on it before the first
touch, and zeroes the view (the kernel then faults 2 MiB pages). Where that cannot work — not
Linux, THP ``never``, a non-CPU device, a tensor under 2 MiB, ``madvise`` refused — it returns
a plain ``torch.zeros`` (also while dynamo traces): a hint, never an error, never a different value. (PyTorch's own
switch, the environment variable ``THP_MEM_ALLOC_ENABLE=1`` set before ``import torch``, does
this for every allocation of 2 MiB or more: weights included; docs/usage.md.)
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

#: the huge page size this module aligns to (x86-64 and arm64 Linux with 4 KiB base pages)
HUGE_PAGE_BYTES = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

_advised_bytes = 0


@functools.cache
def thp_mode() -> str:
    """The kernel's transparent huge page mode: ``"always"``, ``"madvise"``, ``"never"``, or
    ``"absent"`` (not Linux, or no THP); read once per process."""
    if not sys.platform.startswith("linux"):
        return "absent"
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return "absent"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "absent"


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where it cannot be loaded."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advised_bytes() -> int:
    """Bytes this process has asked to put on huge pages through :func:`zeros` (a counter for
    tests and logs; what the kernel granted is in ``/proc/self/smaps``, ``AnonHugePages``)."""
    return _advised_bytes


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed contiguous tensor, on 2 MiB pages where the host allows it (module docstring).

    Args:
        shape: the tensor's shape, e.g. a KV store's ``[batch, num_kv_heads, capacity, head_dim]``.
        dtype: its dtype.
        device: where it lives; anything but the CPU gets a plain ``torch.zeros``.

    Returns:
        A contiguous tensor of zeros; on huge pages its data starts on a 2 MiB boundary and its
        storage holds up to 4 MiB more (address space only: the slack is never touched).
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or thp_mode() not in ("madvise", "always")
            or torch.compiler.is_compiling()):  # traced: a plain allocation, no address arithmetic
        return torch.zeros(shape, dtype=dtype, device=device)
    madvise = _madvise()
    span = math.ceil(nbytes / HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buffer = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    if thp_mode() == "madvise":
        if madvise is None or madvise(buffer.data_ptr() + start, span, _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): %d bytes on base pages",
                         ctypes.get_errno(), nbytes)
            return torch.zeros(shape, dtype=dtype, device=device)
    global _advised_bytes
    _advised_bytes += span
    out = buffer[start:start + nbytes].view(dtype).view(shape)
    return out.zero_()


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`zeros` of ``t``'s shape, dtype and device."""
    return zeros(t.shape, t.dtype, t.device)
