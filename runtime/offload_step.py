"""The arithmetic of an offloaded layer: the resident layer's own code, on rows the offload ops move.

The offload schedule pass (``passes/schedule.py``) calls these functions at the sites of a
decode graph compiled with KV offload, in place of the resident refinement and attention.
Each reads its rows through ``specontext::offload_rows`` (:mod:`.offload_ops`: an
offloaded layer's device buffer, or a resident layer's store) and then runs exactly the
resident step's functions (:mod:`.aten_step`, :mod:`.sparse_attention`) on them. So an
offloaded step and a resident step compute the same logits from the same bits, eager or
compiled by inductor (which traces these functions like the resident ones: only the row
reads stay opaque), and one graph serves every plan as layers leave the device.

``rows`` (every function's first argument) names where a layer's rows live: ``(manager,
ticket, key_cache, value_cache)``, the cache's :class:`~.offload.OffloadManager`, the layer's
prefetch ticket (:func:`~.offload_ops.offload_prefetch`; the first read waits for it) and its
stores ``[batch, num_kv_heads, capacity, head_dim]`` after this step's write.

Not built here (the schedule pass keeps such sites resident, or refuses): the fidelity
guard (``min_coverage``), learned sink logits, MLA. With a selection that covers the whole
store, an offloaded site takes the gather path where a resident one may take SDPA over the
store (``StepSpec.dense_shortcut``): exact both, not bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import cpu_refine, offload_ops  # noqa: F401  (offload_ops registers specontext::offload_rows)
from .aten_step import (
    attend_kept,
    kernel_candidates,
    kernel_visible,
    ranked,
    refine_candidates,
    refine_gathered,
)
from .sparse_attention import attend_gathered
from .spec import AttentionVariant, StepSpec

__all__ = ["attention", "refine", "refine_and_attend"]

_ROWS = torch.ops.specontext.offload_rows.default


def _read(rows, positions: torch.Tensor, length: torch.Tensor, values: bool) -> list[torch.Tensor]:
    manager, ticket, key_cache, value_cache = rows
    return _ROWS(manager, key_cache, value_cache, positions, length, ticket, values)


def attention(rows, query: torch.Tensor, indices: torch.Tensor, length: torch.Tensor,
              attn_mask: torch.Tensor | None, variant: AttentionVariant) -> torch.Tensor:
    """:func:`~.aten_step.sparse_attention` (gather path) of a layer that may be offloaded:
    ``query`` ``[batch, num_heads, q_len, head_dim]`` over ``indices`` ``[batch, num_kv_heads,
    k]`` (int64, ``-1`` padding), ``length`` (int64, this step's tokens included), the site's
    mask and ``variant``. Returns ``[batch, num_heads, q_len, head_dim_v]``."""
    keys, values = _read(rows, indices, length, values=True)
    return attend_gathered(query, keys, values, indices, length, attn_mask, variant)


def refine(rows, query: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
           attn_mask: torch.Tensor | None, pages: Sequence[torch.Tensor | None], spec: StepSpec,
           variant: AttentionVariant) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.aten_step.refine_selection` (guard off) of a layer that may be offloaded: the
    step prefetched ``candidates`` ``[batch, num_kv_heads, slots]``; the page rescue (on the
    device bounds, ``pages``) joins its tokens, the buffer loads what it lacks, and the
    layer's query keeps ``spec.budget`` of them. Returns ``(indices [batch, num_kv_heads,
    budget] int64, dense)``, ``dense`` always a False bool scalar (no guard with offload)."""
    key_cache = rows[2]
    candidates = refine_candidates(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
    (keys,) = _read(rows, candidates, length, values=False)
    indices, _ = refine_gathered(query, keys, candidates, length, attn_mask, spec, variant)
    return indices, torch.zeros((), dtype=torch.bool, device=indices.device)


def refine_and_attend(rows, query: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
                      attn_mask: torch.Tensor | None, pages: Sequence[torch.Tensor | None], spec: StepSpec,
                      variant: AttentionVariant) -> torch.Tensor:
    """:func:`~.aten_step.refine_and_attend` of a layer that may be offloaded (what the
    lowering makes of a :func:`refine` whose kept tokens only :func:`attention` reads): one
    read of the candidates' keys and values (one slot-map lookup per layer and step), then
    the kept tokens' value rows picked from those. Arguments as :func:`refine`; returns
    ``[batch, num_heads, q_len, head_dim_v]``. Where the pass chose our CPU kernel for the
    site (``spec.cpu_kernel``, :func:`~.routes.cpu_kernel`, as for a resident layer) it runs,
    on the rows it read: the kernel's page rescue alone first (:func:`~.cpu_refine.rescue`),
    then the kernel over the loaded rows, the same arithmetic on the same values as the resident layer's (bit-identical)."""
    key_cache = rows[2]
    store = (key_cache, rows[3])
    if spec.cpu_kernel:  # the pass's decision, as a resident layer reads it
        candidates, pages = kernel_candidates(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
        visible = kernel_visible(attn_mask, key_cache)
        if pages:  # the kernel's own page rescue, alone: the candidates whose rows the buffer loads
            candidates = cpu_refine.rescue(query, key_cache, candidates, length, visible, spec, variant, pages)
        keys, values_all = _read(rows, candidates, length, values=True)
        return cpu_refine.refine_attend(query, store, candidates, length, visible, spec, variant,
                                        gathered=(keys, values_all))
    candidates = refine_candidates(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
    keys, values_all = _read(rows, candidates, length, values=True)
    logits, _, values, top = ranked(query, keys, candidates, length, attn_mask, spec, variant)
    kept_rows = values_all.gather(2, top.unsqueeze(-1).expand(*top.shape, values_all.shape[-1]))
    return attend_kept(query, logits, values, top, kept_rows)
