"""KV-store ops (``specontext::``): the write (and the page bounds it touches), the capacity
check, the anchor that brings the cache's state into traced graphs. Bodies: :mod:`.aten_step`,
:mod:`.page_bounds`."""

from __future__ import annotations


import torch

from . import aten_step
from . import key_mirror as key_mirror_module
from . import page_bounds as page_bounds_module

__all__ = ["CacheCapacityError", "check_capacity", "kv_write", "retrieval_anchor"]


class CacheCapacityError(RuntimeError):
    """Raised when a write would pass the end of a preallocated KV store."""


@torch.library.custom_op("specontext::kv_write",
                         mutates_args=("key_cache", "value_cache", "length", "page_bounds", "key_mirror"))
def kv_write(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    length: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    page_bounds: list[torch.Tensor],
    key_mirror: list[torch.Tensor],
    page_shift: torch.Tensor | None = None,
    page_tokens: int = 0,
) -> None:
    """Write ``key``/``value`` ``[batch, num_kv_heads, q_len, head_dim]`` at positions
    ``length .. length+q_len-1`` of the caches ``[batch, num_kv_heads, capacity, head_dim]``
    and advance ``length`` (int64 scalar) by ``q_len``; then, when the store keeps page
    bounds (``page_bounds`` = ``[page_min, page_max]``, each ``[batch, num_kv_heads, pages,
    head_dim]``; ``[]``: none), recompute the bounds of the pages of ``page_tokens`` tokens
    the write touched (``page_shift``: int64 ``[batch]`` per-row page shift, or None; body
    :func:`~specontext_compile.runtime.page_bounds.update_page_bounds`); and when the store
    keeps the selection's int8 keys (``key_mirror`` = ``[key_levels, key_scales]``,
    ``[batch, num_kv_heads, capacity, head_dim]`` int8 and ``[batch, num_kv_heads, capacity]``
    float32; ``[]``: none), the written keys' int8 rows
    (:func:`~specontext_compile.runtime.key_mirror.write_rows`).

    Raises:
        CacheCapacityError: (CPU) when the write would pass ``capacity``; the cache is left
            untouched. Create the cache with a larger ``max_cache_len``.
        ValueError: ``page_bounds`` neither empty nor two tensors, or bounds without
            ``page_tokens``; ``key_mirror`` neither empty nor two tensors.
    """
    _check_page_bounds(page_bounds, page_tokens)
    _check_mirror(key_mirror)
    if key_cache.device.type == "cpu":  # eager CPU only: the host is the device, no sync
        _raise_if_full(length, key_cache, key)
    aten_step.write_kv(key_cache, value_cache, length, key, value)
    page_bounds_module.update_after_write(key_cache, page_bounds, length, key, page_tokens, page_shift)
    key_mirror_module.write_rows(key_cache, key_mirror, length, key)


def _check_page_bounds(page_bounds: list[torch.Tensor], page_tokens: int) -> None:
    if len(page_bounds) not in (0, 2) or (page_bounds and page_tokens <= 0):
        raise ValueError(f"specontext::kv_write: page_bounds must be [] or [page_min, page_max] with "
                         f"page_tokens > 0, got {len(page_bounds)} tensors and page_tokens={page_tokens}")


def _check_mirror(key_mirror: list[torch.Tensor]) -> None:
    if len(key_mirror) not in (0, 2):
        raise ValueError(f"specontext::kv_write: key_mirror must be [] or [key_levels, key_scales], got "
                         f"{len(key_mirror)} tensors")


@kv_write.register_fake
def _(key_cache, value_cache, length, key, value, page_bounds, key_mirror, page_shift=None, page_tokens=0) -> None:
    _check_page_bounds(page_bounds, page_tokens)
    _check_mirror(key_mirror)
    return None


@torch.library.custom_op("specontext::check_capacity", mutates_args=())
def check_capacity(length: torch.Tensor, key_cache: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Raise ``CacheCapacityError`` when writing ``key`` ``[batch, num_kv_heads, q_len,
    head_dim]`` at ``length`` would pass the end of ``key_cache`` (reads ``length`` on the
    host: CPU graphs only). Returns an int64 zero that the layer-0 write adds to its
    positions, so the check runs before any write of the step (see ``passes/lower.py``)."""
    _raise_if_full(length, key_cache, key)
    return torch.zeros((), dtype=torch.long, device=length.device)


def _raise_if_full(length: torch.Tensor, key_cache: torch.Tensor, key: torch.Tensor) -> None:
    start, q_len, capacity = int(length), key.shape[-2], key_cache.shape[-2]
    if start + q_len > capacity:
        raise CacheCapacityError(
            f"SpeContextCache is full: {start} + {q_len} tokens > capacity {capacity}. "
            "Create it with a larger max_cache_len (specontext_compile.compile sizes it "
            "from max_new_tokens).")


@check_capacity.register_fake
def _(length, key_cache, key):
    return length.new_empty(())


@torch.library.custom_op("specontext::retrieval_anchor",
                         mutates_args=("query_state", "query_valid", "stats", "selection_state"))
def retrieval_anchor(
    query_state: torch.Tensor, query_valid: torch.Tensor, stats: torch.Tensor, selection_state: torch.Tensor | None,
    layer_windows: str | None = None, layer: int = 0,
) -> None:
    """No-op in eager mode. It puts the retrieval state tensors and the path counters
    ``stats`` into the traced graph at the start of every KV layer (``layer``: its index
    among the layers with a KV store), where the backend inserts the selection node (the
    first anchor of a graph counts). Arguments:
    :class:`~specontext_compile.runtime.protocol.RetrievalAnchor` (``layer_windows`` is a
    string so that it stays a graph constant even under ``dynamic=True``, where ints may
    become symbols; ``selection_state`` carries a step's selection to the graphs after a
    graph break). Every mutated argument comes before the defaulted ones: torch 2.11's
    version-counter kernel indexes the call's arguments by schema position, and a
    defaulted argument left at its default is dropped from the call (an IndexError there)."""
    return


@retrieval_anchor.register_fake
def _(query_state, query_valid, stats, selection_state, layer_windows=None, layer=0) -> None:
    return None
