"""The plugin's C++ kernel (``csrc/paged_key_logits.cpp``): query-key logits of decode rows over
their blocks of vLLM's paged CPU cache, read in the cache's own packing, one pass per block.
Built like the backend's CPU kernels (:func:`specontext_compile.runtime.cpu_kernels.build_library`);
:func:`available` is False (reason logged once) where it cannot be built, and the caller then
reads the blocks with torch (:meth:`~.layout.BlockLayout.key_logits`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from specontext_compile.runtime.cpu_kernels import build_library, loads

__all__ = ["FORM_CODES", "available", "paged_key_logits", "paged_quest_bounds"]

_SOURCE = Path(__file__).with_name("csrc") / "paged_key_logits.cpp"
#: the key forms the kernel reads (layout.FORMS names) and the dtypes it reads them in
FORM_CODES = {("transposed", torch.float32): 0, ("transposed", torch.bfloat16): 0,
              ("key-tiles16", torch.bfloat16): 1}


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library(_SOURCE)
    for fn in (lib.specontext_paged_key_logits_f32, lib.specontext_paged_key_logits_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [
            ctypes.c_int]
    lib.specontext_paged_quest_bounds.restype = ctypes.c_int
    lib.specontext_paged_quest_bounds.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64] * 5
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here (the reason logged once if not)."""
    return loads(_library, "the paged key-logits kernel", "the selection reads blocks with torch")


def paged_key_logits(kv_cache: torch.Tensor, block_table: torch.Tensor, blocks: int, query: torch.Tensor,
                     form: str) -> torch.Tensor:
    """float32 ``[rows, num_kv_heads, groups, blocks * block_size]`` logits of ``query``
    (float32 ``[rows, num_kv_heads, groups, head_dim]``, already scaled) over each row's first
    ``blocks`` blocks (``block_table`` int32 ``[rows, >= blocks]``) of ``kv_cache``
    (``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, contiguous, keys in ``form``).

    Raises:
        ValueError: a form, dtype or shape the kernel does not take (:data:`FORM_CODES`)."""
    code = FORM_CODES.get((form, kv_cache.dtype))
    _, num_kv, bs, two_d = kv_cache.shape
    rows, _, groups, d = query.shape
    if code is None or not kv_cache.is_contiguous() or two_d != 2 * d or block_table.shape[1] < blocks:
        raise ValueError(f"paged_key_logits: no kernel for {form} keys in {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)} with query {tuple(query.shape)}")
    table = block_table.to(torch.int32).contiguous()
    q = query.to(torch.float32).contiguous()
    out = torch.empty(rows, num_kv, groups, blocks * bs, dtype=torch.float32)
    lib = _library()
    fn = lib.specontext_paged_key_logits_f32 if kv_cache.dtype == torch.float32 else lib.specontext_paged_key_logits_bf16
    status = fn(kv_cache.data_ptr(), table.data_ptr(), table.shape[1], q.data_ptr(), out.data_ptr(), rows, num_kv,
                groups, blocks, bs, d, code)
    if status != 0:
        raise ValueError(f"paged_key_logits rejected block size {bs}, head_dim {d}, form {form}")
    return out


def paged_quest_bounds(low: torch.Tensor, high: torch.Tensor, block_table: torch.Tensor, blocks: int,
                       query: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, num_kv_heads, blocks]``: per row, KV head and logical block ``n`` the
    group-max Quest bound ``max_g sum_j max(q_gj low_j, q_gj high_j)`` of ``query`` (float32
    ``[rows, num_kv_heads, groups, head_dim]``) under the bounds ``low``/``high`` (float32
    ``[num_blocks, num_kv_heads, head_dim]``, contiguous) of block ``block_table[r, n]``.

    Raises:
        ValueError: bounds or a query the kernel does not take."""
    rows, num_kv, groups, d = query.shape
    if (low.dtype != torch.float32 or not low.is_contiguous() or not high.is_contiguous() or low.shape != high.shape
            or low.shape[1:] != (num_kv, d) or block_table.shape[1] < blocks):
        raise ValueError(f"paged_quest_bounds: no kernel for bounds {low.dtype} {tuple(low.shape)} with query "
                         f"{tuple(query.shape)}")
    table = block_table.to(torch.int32).contiguous()
    q = query.to(torch.float32).contiguous()
    out = torch.empty(rows, num_kv, blocks, dtype=torch.float32)
    status = _library().specontext_paged_quest_bounds(low.data_ptr(), high.data_ptr(), table.data_ptr(),
                                                      table.shape[1], q.data_ptr(), out.data_ptr(), rows, num_kv,
                                                      groups, blocks, d)
    if status != 0:
        raise ValueError(f"paged_quest_bounds rejected head_dim {d}, groups {groups}")
    return out
