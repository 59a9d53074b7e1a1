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
from specontext_compile.runtime.cpu_kernels import CSRC, build_library, loads

__all__ = ["FORM_CODES", "available", "paged_key_logits", "paged_lagged_scores", "paged_quest_bounds"]

_SOURCE = Path(__file__).with_name("csrc") / "paged_key_logits.cpp"
#: the key forms the kernel reads (layout.FORMS names) and the dtypes it reads them in
FORM_CODES = {("transposed", torch.float32): 0, ("transposed", torch.bfloat16): 0,
              ("key-tiles16", torch.bfloat16): 1}


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library(_SOURCE, includes=(CSRC,))  # runtime/csrc/cpu_common.h: the exponential
    for fn in (lib.specontext_paged_lagged_scores_f32, lib.specontext_paged_lagged_scores_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [
            ctypes.c_int64] * 6 + [ctypes.c_int]
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


def paged_lagged_scores(caches: list[torch.Tensor], block_table: torch.Tensor, blocks: int, queries: torch.Tensor,
                        past: torch.Tensor, form: str) -> torch.Tensor:
    """float32 ``[rows, num_kv_heads, blocks * block_size]``: the lagged-query head's scores of
    each row's past tokens over several layers in one call, ``sum_i max_g softmax(q_i . k_i)``
    over positions ``< past[r]`` (0 elsewhere), as
    :func:`~specontext_compile.runtime.sparse_attention.group_max_probs` of
    :func:`paged_key_logits` summed over the layers (float32; summation order apart), without
    writing any layer's logits to memory.

    Args:
        caches: the layers' caches ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``,
            one dtype and shape, contiguous, keys in ``form``.
        block_table: int ``[rows, >= blocks]``.
        queries: float32 ``[layers, rows, num_kv_heads, groups, head_dim]``, already scaled.
        past: int ``[rows]``: positions weighed per row (``<= blocks * block_size``).

    Raises:
        ValueError: a form, dtype or shape the kernel does not take (:data:`FORM_CODES`)."""
    first = caches[0]
    code = FORM_CODES.get((form, first.dtype))
    layers, rows, num_kv, groups, d = queries.shape
    _, _, bs, two_d = first.shape
    if (code is None or layers != len(caches) or two_d != 2 * d or block_table.shape[1] < blocks
            or any(c.dtype != first.dtype or c.shape != first.shape or not c.is_contiguous() for c in caches)
            or past.shape != (rows,) or (rows and int(past.max()) > blocks * bs)):
        raise ValueError(f"paged_lagged_scores: no kernel for {len(caches)} {form} caches in {first.dtype} "
                         f"{tuple(first.shape)} with queries {tuple(queries.shape)}, past {tuple(past.shape)}")
    addresses = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    table = block_table.to(torch.int32).contiguous()
    q = queries.to(torch.float32).contiguous()
    lengths = past.to(torch.int64).contiguous()
    out = torch.empty(rows, num_kv, blocks * bs, dtype=torch.float32)
    lib = _library()
    fn = lib.specontext_paged_lagged_scores_f32 if first.dtype == torch.float32 else lib.specontext_paged_lagged_scores_bf16
    status = fn(addresses.data_ptr(), layers, table.data_ptr(), table.shape[1], q.data_ptr(), lengths.data_ptr(),
                out.data_ptr(), rows, num_kv, groups, blocks, bs, d, code)
    if status != 0:
        raise ValueError(f"paged_lagged_scores rejected block size {bs}, head_dim {d}, form {form}")
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
