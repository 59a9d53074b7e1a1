"""Custom ops of the KV offload path (namespace ``specontext``), registered with torch.library.

Inserted into decode graphs by ``passes/schedule.py`` only when offload is enabled (the
``device_memory_bytes`` option); the default path never sees them.

=============================  ==============================================================
op                             role
=============================  ==============================================================
offload_plan                   once per step, after the selection: adaptive plan + step start
offload_prefetch               start elastic loading of one layer on the side stream
offload_wait                   wait for that layer's copy (errors surface here)
sparse_attention_offloaded     sparse attention that reads an offloaded layer's device buffer
=============================  ==============================================================

The state these ops change (device buffers, slot maps, the plan) belongs to the cache's
:class:`~.offload.OffloadManager` and is found from the layer's store tensor, so it never
appears as a graph value. Their order is therefore fixed by data dependence instead of
declared tensor mutation: the plan returns a step token consumed by every prefetch, each
prefetch a ticket consumed by its wait, each wait a ready token consumed by the layer's
attention. Every token is a fresh int64 ``[1]`` tensor that is always used, so no compiler
drops these nodes, and none can run a layer's attention before its wait. A store that no
manager owns (offload not attached to the cache) makes the ops fall back to the resident
path with a warning, so the graph is still exact.
"""

from __future__ import annotations

import logging

import torch

from . import ops
from .offload import lookup

logger = logging.getLogger(__name__)

__all__ = ["offload_plan", "offload_prefetch", "offload_wait", "sparse_attention_offloaded"]

_warned = False


def _token(like: torch.Tensor, value: int) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.long, device=like.device)


def _manager(key_cache: torch.Tensor):
    global _warned
    found = lookup(key_cache)
    if found is None and not _warned:
        _warned = True
        logger.warning("specontext: the graph was compiled with device_memory_bytes but the cache "
                       "has no offload manager; every layer stays resident. Use "
                       "specontext_compile.compile(model, device_memory_bytes=...) or "
                       "runtime.offload.enable_offload(cache, model, ...)")
    return found


@torch.library.custom_op("specontext::offload_plan", mutates_args=())
def offload_plan(indices: torch.Tensor, query_state: torch.Tensor, query_valid: torch.Tensor,
                 key_cache: torch.Tensor, length: torch.Tensor, q_len: int) -> torch.Tensor:
    """Start a decode step: the adaptive plan offloads layers while the cache length after
    this step (``length + q_len``) reaches ``ST[offloaded]``.

    Args:
        indices: the step's selection ``[batch, num_kv_heads, budget]`` (int64, -1 padding).
        query_state, query_valid: the retrieval state (kept for rollback).
        key_cache: any layer's store of the cache (identifies the manager).
        length: tokens cached before this step (int64 scalar).
        q_len: tokens in this step.

    Returns:
        int64 ``[1]`` step token (consumed by every prefetch).
    """
    found = _manager(key_cache)
    if found is not None:
        found[0].begin_step(indices, query_state, query_valid, int(length), q_len)
    return _token(indices, 0)


@offload_plan.register_fake
def _(indices, query_state, query_valid, key_cache, length, q_len):
    return indices.new_empty((1,))


@torch.library.custom_op("specontext::offload_prefetch", mutates_args=())
def offload_prefetch(step: torch.Tensor, indices: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, length: torch.Tensor, layer: int) -> torch.Tensor:
    """Start loading the selected rows of one layer into its device buffer (elastic
    loading, on the side stream); a no-op for a resident layer.

    Args:
        step: the token of :func:`offload_plan`.
        indices: the selection ``[batch, num_kv_heads, budget]``.
        key_cache, value_cache: the layer's stores ``[batch, num_kv_heads, capacity, head_dim]``
            (the host tier once offloaded).
        length: the layer's written tokens now; only positions below it are loaded here.
        layer: decoder layer index (for logs and traces).

    Returns:
        int64 ``[1]`` ticket (-1: nothing started).
    """
    found = _manager(key_cache)
    if found is None:
        return _token(indices, -1)
    manager, layer_idx = found
    return _token(indices, manager.prefetch(layer_idx, indices, int(length)))


@offload_prefetch.register_fake
def _(step, indices, key_cache, value_cache, length, layer):
    return indices.new_empty((1,))


@torch.library.custom_op("specontext::offload_wait", mutates_args=())
def offload_wait(ticket: torch.Tensor, key_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Wait for the prefetch ``ticket`` of one layer.

    Raises:
        OffloadCopyError: when the copy failed (the host tier is intact; see
            :meth:`~.offload.OffloadManager.rollback`).

    Returns:
        int64 ``[1]`` ready token (consumed by the layer's attention).
    """
    found = _manager(key_cache)
    if found is not None:
        found[0].wait(int(ticket), found[1])
    return _token(ticket, 1)


@offload_wait.register_fake
def _(ticket, key_cache, layer):
    return ticket.new_empty((1,))


@torch.library.custom_op("specontext::sparse_attention_offloaded", mutates_args=())
def sparse_attention_offloaded(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, indices: torch.Tensor,
    length: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, kernel: str,
    soft_cap: float | None, sliding_window: int, ready: torch.Tensor, layer: int,
) -> torch.Tensor:
    """``specontext::sparse_attention`` for a layer that may be offloaded: a resident layer
    runs it unchanged; an offloaded layer reads its device buffer through the slot map
    (torch path; ``kernel`` applies to resident layers only). ``ready`` is the layer's
    wait token; ``soft_cap``/``sliding_window`` as in ``sparse_attention``. Shapes as
    :func:`~.ops.sparse_attention`."""
    found = _manager(key_cache)
    if found is not None:
        manager, layer_idx = found
        if layer_idx in manager.buffers:
            out = manager.attend(layer_idx, query, key_cache, value_cache, indices, length,
                                 attn_mask, scale, soft_cap, sliding_window)
            manager.mark_layer(layer_idx, True)
            return out
    out = _resident(query, key_cache, value_cache, indices, length, attn_mask, scale, kernel,
                    soft_cap, sliding_window)
    if found is not None:
        found[0].mark_layer(found[1], False)
    return out


def _resident(query, key_cache, value_cache, indices, length, attn_mask, scale, kernel, soft_cap, sliding_window):
    """The ordinary sparse attention (the selection comes from a selection node, so the
    static dense shortcut applies)."""
    return ops.sparse_attention(query, key_cache, value_cache, indices, length, attn_mask, scale,
                                kernel, soft_cap, sliding_window, True)


@sparse_attention_offloaded.register_fake
def _(query, key_cache, value_cache, indices, length, attn_mask, scale, kernel, soft_cap,
      sliding_window, ready, layer):
    b, h, q_len, _ = query.shape
    return query.new_empty((b, h, q_len, value_cache.shape[-1]))
