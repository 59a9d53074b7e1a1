"""The plugin's C++ kernels, reading vLLM's paged CPU cache in its own packing
(``csrc/paged_blocks.h``): ``csrc/paged_key_logits.cpp``, query-key logits of decode rows over
their blocks (the selection's scores, the rescue's Quest bounds), one pass per block; and
``csrc/paged_refine_attention.cpp``, a layer's refinement of its candidates to ``budget`` tokens
and its attention over them (:mod:`.refine`).
Built like the backend's CPU kernels (:func:`specontext_compile.runtime.cpu_kernels.build_library`);
:func:`available` is False (reason logged once) where it cannot be built (and
:func:`refine_available` for the refinement's library), and the caller then reads the blocks
with torch (:meth:`~.layout.BlockLayout.key_logits`, :func:`.refine.refine_torch`)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from specontext_compile.runtime.cpu_kernels import CSRC, build_library, loads
from specontext_compile.runtime.int8_keys import dequantize_rows

__all__ = ["FORM_CODES", "VALUE_FORM_CODES", "available", "paged_key_logits", "paged_lagged_scores",
           "paged_lagged_scores_int8", "int8_dot_calls", "paged_quest_bounds", "paged_refine_attention", "refine_available"]

_SOURCE = Path(__file__).with_name("csrc") / "paged_key_logits.cpp"
_REFINE_SOURCE = Path(__file__).with_name("csrc") / "paged_refine_attention.cpp"
#: the key forms the kernel reads (layout.FORMS names) and the dtypes it reads them in
FORM_CODES = {("transposed", torch.float32): 0, ("transposed", torch.bfloat16): 0,
              ("key-tiles16", torch.bfloat16): 1}
#: the largest block size (tokens) the kernels read (``kMaxBlock`` in ``csrc/paged_blocks.h``)
MAX_BLOCK = 128
#: the value forms the refinement kernel reads, by dtype
VALUE_FORM_CODES = {("rows", torch.float32): 0, ("rows", torch.bfloat16): 0, ("value-tiles16", torch.bfloat16): 1}


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
    lib.specontext_paged_lagged_scores_int8.restype = ctypes.c_int
    lib.specontext_paged_lagged_scores_int8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p,
                                                        ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
    lib.specontext_paged_lagged_scores_int8_dot_calls.restype = ctypes.c_int64
    lib.specontext_paged_quest_bounds.restype = ctypes.c_int
    lib.specontext_paged_quest_bounds.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64] * 5
    return lib


@functools.cache
def _refine_library() -> ctypes.CDLL:
    lib = build_library(_REFINE_SOURCE, includes=(CSRC,))
    for fn in (lib.specontext_paged_refine_attention_f32, lib.specontext_paged_refine_attention_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 3
    return lib


@functools.cache
def refine_available() -> bool:
    """Whether the refinement kernel builds and loads here (the reason logged once if not)."""
    return loads(_refine_library, "the paged refinement kernel", "the refinement reads tokens with torch")


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


def paged_lagged_scores_int8(copies: list, block_table: torch.Tensor, blocks: int,
                             queries: tuple[torch.Tensor, torch.Tensor], past: torch.Tensor) -> torch.Tensor:
    """:func:`paged_lagged_scores` over the layers' int8 copies of their keys
    (:class:`~.int8_keys.Int8Keys`, option ``selection_keys="int8"``), the query rows as int8
    levels too, as the backend's selection kernel scores them (``runtime/csrc/selection_scores.cpp``):
    the logit of a token is ``key scale * query scale * (query levels . key levels)``, the
    integer dot products exact (``VPDPBUSD`` where the CPU has AVX-512 VNNI, :func:`int8_dot_calls`),
    the rest as there (float32; summation order apart).

    Args:
        copies: the layers' :class:`~.int8_keys.Int8Keys`, one shape.
        block_table, past: as :func:`paged_lagged_scores`.
        queries: the query rows' levels and scales (:func:`~specontext_compile.runtime.int8_keys.quantize_rows`
            of the scaled query ``[layers, rows, num_kv_heads, groups, head_dim]``): int8 and float32.

    Raises:
        ValueError: copies, queries or lengths the kernel does not take."""
    q_levels, q_scales = queries
    first = copies[0]
    layers, rows, num_kv, groups, d = q_levels.shape
    _, _, bs, _ = first.levels.shape
    if (layers != len(copies) or block_table.shape[1] < blocks or past.shape != (rows,) or q_levels.dtype != torch.int8
            or q_scales.shape != q_levels.shape[:-1]
            or any(c.levels.shape != first.levels.shape or c.levels.dtype != torch.int8 or c.scales.dtype != torch.float32
                   or c.levels.shape[1:] != (num_kv, bs, d) or not (c.levels.is_contiguous() and c.scales.is_contiguous())
                   for c in copies)
            or (rows and int(past.max()) > blocks * bs)):
        raise ValueError(f"paged_lagged_scores_int8: no kernel for {len(copies)} copies of "
                         f"{tuple(first.levels.shape)} with query levels {tuple(q_levels.shape)}, past {tuple(past.shape)}")
    levels = torch.tensor([c.levels.data_ptr() for c in copies], dtype=torch.int64)
    scales = torch.tensor([c.scales.data_ptr() for c in copies], dtype=torch.int64)
    table = block_table.to(torch.int32).contiguous()
    q8 = q_levels.contiguous()
    q_scale = q_scales.to(torch.float32).contiguous()
    values = dequantize_rows(q8, q_scale).contiguous()  # the float loops' query
    sums = q8.sum(-1, dtype=torch.int32).contiguous()
    lengths = past.to(torch.int64).contiguous()
    out = torch.empty(rows, num_kv, blocks * bs, dtype=torch.float32)
    status = _library().specontext_paged_lagged_scores_int8(
        levels.data_ptr(), scales.data_ptr(), layers, table.data_ptr(), table.shape[1], values.data_ptr(), q8.data_ptr(),
        q_scale.data_ptr(), sums.data_ptr(), lengths.data_ptr(), out.data_ptr(), rows, num_kv, groups, blocks, bs, d)
    if status != 0:
        raise ValueError(f"paged_lagged_scores_int8 rejected block size {bs}, head_dim {d}, groups {groups}")
    return out


def int8_dot_calls() -> int:
    """Calls of :func:`paged_lagged_scores_int8` in this process that took the int8 dot
    products (AVX-512 VNNI, head_dim a multiple of 64, a group size the kernel unrolls)."""
    return int(_library().specontext_paged_lagged_scores_int8_dot_calls())


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


def paged_refine_attention(kv_cache: torch.Tensor, tables: torch.Tensor, logical: torch.Tensor, lens: torch.Tensor,
                           row_len: torch.Tensor, query: torch.Tensor, forms: tuple[str, str], budget: int,
                           sinks: int, recent: int, coverage: bool = False):
    """float32 ``[rows, num_kv_heads, groups, head_dim]``: each decode row's attention, per KV
    head, over the ``budget`` best of its candidate tokens (``csrc/paged_refine_attention.cpp``
    states the arithmetic; :func:`.refine.refine_torch` is the same in torch); with
    ``coverage``, also float32 ``[rows, num_kv_heads]``: the fidelity guard's estimate, the
    smallest over the group's query heads of the candidates' softmax mass the kept tokens hold.

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, contiguous, keys and
            values in ``forms`` (:data:`FORM_CODES`, :data:`VALUE_FORM_CODES`).
        tables: int ``[rows, num_kv_heads, width]`` physical blocks of the candidates;
            logical: int ``[rows, num_kv_heads, width]`` their logical blocks, ascending;
            lens: int ``[rows, num_kv_heads]`` candidate tokens (whole blocks, the last one's
            written tokens), ``1 <= lens <= width * block_size``.
        row_len: int ``[rows]`` each row's tokens, this step's included.
        query: float32 ``[rows, num_kv_heads, groups, head_dim]``, already scaled.
        budget, sinks, recent: tokens kept, forced first candidates, forced last positions.

    Raises:
        ValueError: forms, dtype or shapes the kernel does not take, or a physical block outside
            the cache."""
    key_code = FORM_CODES.get((forms[0], kv_cache.dtype))
    value_code = VALUE_FORM_CODES.get((forms[1], kv_cache.dtype))
    _, num_kv, bs, two_d = kv_cache.shape
    rows, _, groups, d = query.shape
    width = tables.shape[-1]
    if (key_code is None or value_code is None or not kv_cache.is_contiguous() or two_d != 2 * d
            or tables.shape != (rows, num_kv, width) or logical.shape != tables.shape or lens.shape != (rows, num_kv)
            or row_len.shape != (rows,)):
        raise ValueError(f"paged_refine_attention: no kernel for {forms} in {kv_cache.dtype} {tuple(kv_cache.shape)} "
                         f"with query {tuple(query.shape)}, tables {tuple(tables.shape)}")
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < kv_cache.shape[0]:
        raise ValueError(f"paged_refine_attention: physical blocks {int(tables.min())}..{int(tables.max())} outside "
                         f"the cache's {kv_cache.shape[0]}")
    tables32 = tables.to(torch.int32).contiguous()
    logical64 = logical.to(torch.int64).contiguous()
    lens32 = lens.to(torch.int32).contiguous()
    row_len64 = row_len.to(torch.int64).contiguous()
    q = query.to(torch.float32).contiguous()
    out = torch.empty(rows, num_kv, groups, d, dtype=torch.float32)
    share = torch.empty(rows, num_kv, dtype=torch.float32) if coverage else None
    lib = _refine_library()
    fn = (lib.specontext_paged_refine_attention_f32 if kv_cache.dtype == torch.float32
          else lib.specontext_paged_refine_attention_bf16)
    status = fn(kv_cache.data_ptr(), tables32.data_ptr(), logical64.data_ptr(), lens32.data_ptr(),
                row_len64.data_ptr(), q.data_ptr(), out.data_ptr(), share.data_ptr() if coverage else None, rows,
                num_kv, groups, width, bs, d, key_code,
                value_code, budget, sinks, recent)
    if status != 0:
        raise ValueError(f"paged_refine_attention rejected block size {bs}, head_dim {d}, forms {forms}, "
                         f"budget {budget} or candidate counts outside 1..{width * bs}")
    return (out, share) if coverage else out
