"""Custom ops of the KV offload path (namespace ``specontext``), registered with torch.library.

Inserted into decode graphs by ``passes/schedule.py`` only when offload is enabled (the
``device_memory_bytes`` option); the default path never sees them. They *move* rows and run
the plan; they compute nothing. The arithmetic of an offloaded layer (refinement, attention)
is the resident layer's own code, called by :mod:`.offload_step` on the rows these ops
return, so a compiled step traces it like the resident step's (issue 27, item 5).

=============================  ==============================================================
op                             role
=============================  ==============================================================
offload_plan                   layer 0 (the cache calls it): brings the cache's
                               OffloadManager into the graph; in a scheduled decode graph
                               it runs the adaptive plan and starts the step
offload_prefetch               start elastic loading of one layer on the side stream
offload_rows                   wait for that layer's copy (errors surface here), then the K
                               (and V) rows of given positions: from an offloaded layer's
                               device buffer (loading what it lacks), else the store
=============================  ==============================================================

**Plan and run.** The plan (memory model, thresholds, which layers live in the host tier)
is host-side Python, once per step (``offload_plan``); the run ops read the step's tensors
and the manager's buffers. On CPU they read lengths on the host, where they already are.

**Declared effects.** The state these ops change (device buffers, slot maps, the plan)
belongs to the cache's :class:`~.offload.OffloadManager`, a torch opaque reference object:
every op takes it as its first argument (``manager``), so it is an explicit graph input
(dynamo lifts it from ``cache.offload`` at ``offload_plan``), and an op with an opaque
argument carries an *ordered effect* (``torch._library.effects``): compilers (AOTAutograd,
inductor) thread effect tokens through such ops and never reorder or drop them. Their
order is also fixed by data dependence: the plan returns each layer's index (a 0-d int64
CPU tensor) consumed by its prefetch, each prefetch a ticket consumed by the layer's ``offload_rows``. The layer index travels in
these tensors, never as a constant of a layer's code, so regional compilation compiles the
repeated decoder layer once.
There is no lookup from store pointers to managers; a graph whose cache has no manager has
no ``offload_plan``, and the schedule pass leaves it resident (with a warning).
"""

from __future__ import annotations

import logging

import torch

from .offload import OffloadManager
from .torch_private import ordered_effect

logger = logging.getLogger(__name__)

__all__ = ["offload_plan", "offload_prefetch", "offload_rows"]

@torch.library.custom_op("specontext::offload_plan", mutates_args=())
def offload_plan(manager: OffloadManager, query_state: torch.Tensor, query_valid: torch.Tensor,
                 length: torch.Tensor, q_len: int, layers: int, run: bool = False) -> list[torch.Tensor]:
    """The cache calls it at layer 0 (``SpeContextCache.update``, before the layer's write),
    so the manager enters every traced graph as an explicit input; a no-op until the schedule
    pass sets ``run`` in a decode graph it schedules. With ``run``: start a decode step, the
    adaptive plan offloads layers while the cache length after this step (``length + q_len``)
    reaches ``ST[offloaded]`` (:meth:`~.offload.OffloadManager.begin_step`).

    Args:
        manager: the cache's :class:`~.offload.OffloadManager`.
        query_state, query_valid: the retrieval state (kept for rollback).
        length: tokens cached before this step (int64 scalar).
        q_len: tokens in this step.
        layers: decoder layers of the cache.
        run: run the plan (set by ``passes/schedule.py``); False: the marker only.

    Returns:
        ``layers`` int64 0-d CPU tensors ``0 .. layers-1``: each layer's index for its
        prefetch (so every prefetch runs after the plan).
    """
    if run:
        manager.begin_step(query_state, query_valid, int(length), q_len)
    return [torch.tensor(i) for i in range(layers)]


@offload_plan.register_fake
def _(manager, query_state, query_valid, length, q_len, layers, run=False):
    return [torch.empty((), dtype=torch.long) for _ in range(layers)]


@torch.library.custom_op("specontext::offload_prefetch", mutates_args=())
def offload_prefetch(manager: OffloadManager, indices: torch.Tensor, length: torch.Tensor,
                     layer: torch.Tensor) -> torch.Tensor:
    """Start loading the selected rows of one layer into its device buffer (elastic
    loading, on the side stream); a no-op for a resident layer.

    Args:
        manager: the cache's :class:`~.offload.OffloadManager`.
        indices: the selection ``[batch, num_kv_heads, budget]`` (int64, -1 padding).
        length: the layer's written tokens now; only positions below it are loaded here.
        layer: the decoder layer (the manager's), an int64 0-d CPU tensor of :func:`offload_plan`.

    Returns:
        int64 CPU ``[2]`` ticket: ``(ticket id or -1 when nothing started, layer)``.
    """
    index = int(layer)
    return torch.tensor([manager.prefetch(index, indices, int(length)), index])


@offload_prefetch.register_fake
def _(manager, indices, length, layer):
    return torch.empty((2,), dtype=torch.long)


@torch.library.custom_op("specontext::offload_rows", mutates_args=())
def offload_rows(manager: OffloadManager, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 positions: torch.Tensor, length: torch.Tensor, ticket: torch.Tensor, values: bool) -> list[torch.Tensor]:
    """The rows of ``positions`` ``[batch, num_kv_heads, n]`` (int64, ``-1`` padding) of one
    layer, after waiting for the layer's prefetch ``ticket`` (the first read of a step waits;
    a later read of the same ticket finds it done): from its device buffer when the layer is
    offloaded (the rows it lacks, the step's own tokens and rescued pages' tokens, are loaded
    from the host tier first: :meth:`~.offload.OffloadManager.rows`), else gathered from its
    store, as the resident step gathers them. A ``-1`` position gives some row of the layer
    (attention gives it no weight).

    Args:
        manager: the cache's :class:`~.offload.OffloadManager`.
        key_cache, value_cache: the layer's stores ``[batch, num_kv_heads, capacity, head_dim]``
            (the host tier once offloaded), after this step's write.
        positions: the positions to read.
        length: int64 scalar, tokens written including this step's.
        ticket: the layer's int64 CPU ``[2]`` ticket from :func:`offload_prefetch`.
        values: also the values (a refinement reads keys only).

    Returns:
        ``[keys]`` or ``[keys, values]``, each ``[batch, num_kv_heads, n, head_dim]``.

    Raises:
        OffloadCopyError: the layer's copy failed (the host tier is intact; see
            :meth:`~.offload.OffloadManager.rollback`).
        RuntimeError: a position the buffer cannot hold (no prefetch ran).
    """
    ticket_id, layer = (int(v) for v in ticket)
    manager.wait(ticket_id, layer)
    return manager.rows(layer, key_cache, value_cache, positions, length, values)


@offload_rows.register_fake
def _(manager, key_cache, value_cache, positions, length, ticket, values):
    b, h, n = positions.shape
    stores = (key_cache, value_cache) if values else (key_cache,)
    return [store.new_empty((b, h, n, store.shape[-1])) for store in stores]


def _declare_effects() -> None:
    """Ordered effects for every op that takes the manager (torch does not infer them for
    opaque arguments): compilers thread effect tokens through them, never reorder or drop."""
    for op in (offload_plan, offload_prefetch, offload_rows):
        ordered_effect(op._opoverload)


_declare_effects()
