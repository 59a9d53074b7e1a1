"""Custom ops of the KV offload path (namespace ``specontext``), registered with torch.library.

Inserted into decode graphs by ``passes/schedule.py`` only when offload is enabled (the
``device_memory_bytes`` option); the default path never sees them.

=============================  ==============================================================
op                             role
=============================  ==============================================================
offload_anchor                 layer 0: brings the cache's OffloadManager into the graph
offload_plan                   once per step, after the selection: adaptive plan + step start
offload_prefetch               start elastic loading of one layer on the side stream
offload_wait                   wait for that layer's copy (errors surface here)
refine_selection_offloaded     two-stage selection: the layer's top budget of the prefetched candidates
sparse_attention_offloaded     sparse attention that reads an offloaded layer's device buffer
=============================  ==============================================================

**Declared effects.** The state these ops change (device buffers, slot maps, the plan)
belongs to the cache's :class:`~.offload.OffloadManager`, a torch opaque reference object:
every op takes it as its first argument (``manager``), so it is an explicit graph input
(dynamo lifts it from ``cache.offload`` at ``offload_anchor``), and an op with an opaque
argument carries an *ordered effect* (``torch._library.effects``): compilers thread effect
tokens through such ops and never reorder or drop them. Their order is also fixed by data
dependence: the plan returns a step token consumed by every prefetch, each prefetch a
ticket consumed by its wait, each wait a ready token consumed by the layer's attention.
There is no lookup from store pointers to managers; a graph whose cache has no manager has
no ``offload_anchor``, and the schedule pass leaves it resident (with a warning).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch._dynamo.utils import counters

from . import aten_step, ops
from .offload import OffloadManager
from .spec import AttentionVariant, StepSpec

logger = logging.getLogger(__name__)

__all__ = ["offload_anchor", "offload_plan", "offload_prefetch", "offload_wait", "refine_selection_offloaded",
           "sparse_attention_offloaded"]

def _token(like: torch.Tensor, value: int) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.long, device=like.device)


@torch.library.custom_op("specontext::offload_anchor", mutates_args=())
def offload_anchor(manager: OffloadManager) -> None:
    """No-op in eager mode: puts the cache's offload manager into the traced graph at layer 0
    (``SpeContextCache.update``), where the schedule pass reads it."""
    return


@offload_anchor.register_fake
def _(manager) -> None:
    return None


@torch.library.custom_op("specontext::offload_plan", mutates_args=())
def offload_plan(manager: OffloadManager, indices: torch.Tensor, query_state: torch.Tensor,
                 query_valid: torch.Tensor, key_cache: torch.Tensor, length: torch.Tensor, q_len: int) -> torch.Tensor:
    """Start a decode step: the adaptive plan offloads layers while the cache length after
    this step (``length + q_len``) reaches ``ST[offloaded]``.

    Args:
        manager: the cache's :class:`~.offload.OffloadManager`.
        indices: the step's selection ``[batch, num_kv_heads, budget]`` (int64, -1 padding).
        query_state, query_valid: the retrieval state (kept for rollback).
        key_cache: layer 0's store (orders the plan after the selection's inputs).
        length: tokens cached before this step (int64 scalar).
        q_len: tokens in this step.

    Returns:
        int64 ``[1]`` step token (consumed by every prefetch).
    """
    manager.begin_step(indices, query_state, query_valid, int(length), q_len)
    return _token(indices, 0)


@offload_plan.register_fake
def _(manager, indices, query_state, query_valid, key_cache, length, q_len):
    return indices.new_empty((1,))


@torch.library.custom_op("specontext::offload_prefetch", mutates_args=())
def offload_prefetch(manager: OffloadManager, step: torch.Tensor, indices: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, length: torch.Tensor, layer: int) -> torch.Tensor:
    """Start loading the selected rows of one layer into its device buffer (elastic
    loading, on the side stream); a no-op for a resident layer.

    Args:
        manager: the cache's :class:`~.offload.OffloadManager`.
        step: the token of :func:`offload_plan`.
        indices: the selection ``[batch, num_kv_heads, budget]``.
        key_cache, value_cache: the layer's stores ``[batch, num_kv_heads, capacity, head_dim]``
            (the host tier once offloaded).
        length: the layer's written tokens now; only positions below it are loaded here.
        layer: decoder layer index (the manager's layer).

    Returns:
        int64 ``[1]`` ticket (-1: nothing started).
    """
    return _token(indices, manager.prefetch(layer, indices, int(length)))


@offload_prefetch.register_fake
def _(manager, step, indices, key_cache, value_cache, length, layer):
    return indices.new_empty((1,))


@torch.library.custom_op("specontext::offload_wait", mutates_args=())
def offload_wait(manager: OffloadManager, ticket: torch.Tensor, key_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Wait for the prefetch ``ticket`` of one layer.

    Raises:
        OffloadCopyError: when the copy failed (the host tier is intact; see
            :meth:`~.offload.OffloadManager.rollback`).

    Returns:
        int64 ``[1]`` ready token (consumed by the layer's attention).
    """
    manager.wait(int(ticket), layer)
    return _token(ticket, 1)


@offload_wait.register_fake
def _(manager, ticket, key_cache, layer):
    return ticket.new_empty((1,))


@torch.library.custom_op("specontext::sparse_attention_offloaded", mutates_args=())
def sparse_attention_offloaded(
    manager: OffloadManager, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, indices: torch.Tensor,
    length: torch.Tensor, attn_mask: Optional[torch.Tensor], spec: StepSpec, variant: AttentionVariant,
    ready: torch.Tensor, layer: int,
) -> torch.Tensor:
    """``specontext::sparse_attention`` for a layer that may be offloaded: a resident layer
    runs it unchanged; an offloaded layer reads its device buffer through the slot map
    (torch path; ``spec.kernel`` applies to resident layers only). ``ready`` is the layer's
    wait token; ``spec``/``variant`` as in ``sparse_attention``. Shapes as
    :func:`~.ops.sparse_attention`."""
    if layer in manager.buffers:
        out = manager.attend(layer, query, key_cache, value_cache, indices, length, attn_mask, variant)
        manager.mark_layer(layer, True)
        return out
    out = ops.sparse_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)
    manager.mark_layer(layer, False)
    return out


@torch.library.custom_op("specontext::refine_selection_offloaded", mutates_args=())
def refine_selection_offloaded(
    manager: OffloadManager, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    candidates: torch.Tensor, length: torch.Tensor, attn_mask: Optional[torch.Tensor],
    pages: list[Optional[torch.Tensor]], spec: StepSpec, variant: AttentionVariant, ready: torch.Tensor, layer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``specontext::refine_selection`` for a layer that may be offloaded (option
    ``candidates > 1`` with KV offload): the step prefetched the *candidates*; an offloaded
    layer scores them from its device buffer (:meth:`~.offload.OffloadManager.refine`), a
    resident one from its store. ``ready`` is the layer's wait token. The fidelity guard is
    not built for offloaded layers (the config refuses ``min_coverage`` with offload), so
    the second output is always False. ``pages``: the page rescue (as
    ``refine_selection``'s); an offloaded layer loads the rescued tokens it lacks from the
    host tier. Returns ``(indices [batch, num_kv_heads, budget]
    int64, dense: bool scalar)`` as ``refine_selection``."""
    counters["specontext"]["refine_calls"] += 1
    if layer in manager.buffers:
        kept = manager.refine(layer, query, key_cache, value_cache, candidates, length, attn_mask, pages, spec,
                              variant)
    else:
        kept, _ = aten_step.refine_selection(query, key_cache, candidates, length, attn_mask, pages, spec, variant)
    return kept, torch.zeros((), dtype=torch.bool, device=kept.device)


@refine_selection_offloaded.register_fake
def _(manager, query, key_cache, value_cache, candidates, length, attn_mask, pages, spec, variant, ready, layer):
    b, kv = candidates.shape[:2]
    return candidates.new_empty((b, kv, spec.budget)), torch.empty((), dtype=torch.bool, device=candidates.device)


@sparse_attention_offloaded.register_fake
def _(manager, query, key_cache, value_cache, indices, length, attn_mask, spec, variant, ready, layer):
    b, h, q_len, _ = query.shape
    return query.new_empty((b, h, q_len, value_cache.shape[-1]))


def _declare_effects() -> None:
    """Ordered effects for every op that takes the manager (torch does not infer them for
    opaque arguments): compilers thread effect tokens through them, never reorder or drop."""
    from torch._library.effects import EffectType

    for op in (offload_anchor, offload_plan, offload_prefetch, offload_wait, refine_selection_offloaded,
               sparse_attention_offloaded):
        torch.library._register_effectful_op(op._opoverload, EffectType.ORDERED)


_declare_effects()
