"""The per-layer refinement over vLLM's blocks (issue 54, item 1; options ``page_rescue`` and
``candidates``), as our backend's step does it (``runtime/aten_step.py``: ``ranked``,
``attend_kept``).

A layer that refines takes its candidates, per decode row and KV head, from the blocks the
step's shared selection kept (``candidates x budget`` tokens in whole blocks) and the blocks
this layer rescued by their Quest bound (:mod:`.rescue`), ranks every candidate token by its
exact group-max softmax probability under the layer's own query, keeps the ``budget`` best
(the first ``sinks`` candidates and the last ``recent`` positions always), and attends to the
kept tokens only. Its keys are read once for the group and only the kept tokens' values are
read: where it reads the cache's packing, one call of the plugin's C++ kernel per layer
(:func:`~.kernels.paged_refine_attention`); elsewhere :func:`refine_torch`, the same arithmetic.

``sinks`` and ``recent`` follow the backend: ``recent = min(recent_window, budget)`` (at least
the step's own token), ``sinks = min(sink_tokens, budget - recent)``.
"""

from __future__ import annotations

import torch

from . import kernels
from .layout import BlockLayout
from .selection import BlockSelection

__all__ = ["forced_counts", "refine_attend", "refine_torch"]


def forced_counts(budget: int, sink_tokens: int, recent_window: int) -> tuple[int, int]:
    """``(sinks, recent)``: the candidates kept whatever their rank, as the backend's ranking
    counts them (``aten_step.ranked``, one query row)."""
    recent = min(max(recent_window, 1), budget)
    return min(sink_tokens, budget - recent), recent


def refine_attend(layout: BlockLayout, kv_cache: torch.Tensor, block_table: torch.Tensor, selection: BlockSelection,
                  query: torch.Tensor, scale: float, row_len: torch.Tensor, budget: int, sinks: int, recent: int,
                  coverage: bool = False):
    """Each decode row's attention over the ``budget`` best tokens of its candidates.

    Args:
        layout: the cache's packing (:func:`~.layout.probe_layout`).
        kv_cache: the layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``.
        block_table: int ``[rows, max_blocks]`` (vLLM's, the decode rows').
        selection: the candidates' blocks per row and KV head (:class:`~.selection.BlockSelection`,
            the current block among them).
        query: ``[rows, num_heads, head_dim]`` (heads grouped by KV head), any float dtype.
        scale: the softmax scale.
        row_len: int ``[rows]``: each row's tokens, this step's included.
        budget, sinks, recent: tokens kept, and of them those forced (:func:`forced_counts`).

    Returns:
        float32 ``[rows, num_heads, head_dim]``; with ``coverage``, also float32 ``[rows,
        num_kv_heads]``, the fidelity guard's estimate (option ``min_coverage``; the backend's
        ``aten_step.refine_gathered``): per KV head the smallest, over its query heads, share of
        the candidates' softmax mass that the kept tokens hold (1.0: nothing dropped).
    """
    rows, num_kv, width = selection.tables.shape
    q = (query.float() * scale).view(rows, num_kv, -1, layout.head_dim)
    forms = (layout.key_form, layout.value_form)
    if ((forms[0], kv_cache.dtype) in kernels.FORM_CODES and (forms[1], kv_cache.dtype) in kernels.VALUE_FORM_CODES
            and layout.block_size <= kernels.MAX_BLOCK and kv_cache.is_contiguous() and kernels.refine_available()):
        result = kernels.paged_refine_attention(kv_cache, selection.tables, selection.logical, selection.seq_lens,
                                                row_len, q, forms, budget, sinks, recent, coverage)
    else:
        result = refine_torch(layout, kv_cache, block_table, selection, q, row_len, budget, sinks, recent, coverage)
    out, share = result if coverage else (result, None)
    out = out.view(rows, -1, layout.head_dim)
    return (out, share) if coverage else out


def refine_torch(layout: BlockLayout, kv_cache: torch.Tensor, block_table: torch.Tensor, selection: BlockSelection,
                 query: torch.Tensor, row_len: torch.Tensor, budget: int, sinks: int, recent: int,
                 coverage: bool = False):
    """:func:`refine_attend`'s arithmetic in torch (``query`` float32 ``[rows, num_kv_heads,
    groups, head_dim]``, already scaled): float32 ``[rows, num_kv_heads, groups, head_dim]``,
    the candidates' tokens gathered through ``layout`` (any packing); with ``coverage``, also
    its float32 ``[rows, num_kv_heads]`` estimate (:func:`refine_attend`)."""
    rows, num_kv, width = selection.logical.shape
    bs = layout.block_size
    index = torch.arange(width * bs, device=query.device)
    positions = selection.logical.clamp(min=0).repeat_interleave(bs, dim=-1) * bs + index % bs  # [rows, kv, n]
    valid = index < selection.seq_lens.long().unsqueeze(-1)
    keys, values = layout.gather(kv_cache, block_table, torch.where(valid, positions, -1))
    logits = torch.einsum("rkgd,rknd->rkgn", query, keys.float()).masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [rows, kv, groups, n]
    rank = probs.amax(dim=2)  # [rows, kv, n]
    forced = valid & ((index < sinks) | (positions >= row_len.long().view(rows, 1, 1) - recent))
    rank = torch.where(forced, float("inf"), torch.where(valid, rank, -1.0))  # below every valid rank
    # ties: the earliest candidates first, as the kernel keeps them
    top = rank.sort(dim=-1, descending=True, stable=True).indices[..., : min(budget, width * bs)]  # [rows, kv, kept]
    usable = valid.gather(-1, top)  # fewer candidates than the budget: the rest are padding
    groups = query.shape[2]
    kept_logits = logits.gather(-1, top.unsqueeze(2).expand(rows, num_kv, groups, top.shape[-1]))
    kept_logits = kept_logits.masked_fill(~usable.unsqueeze(2), float("-inf"))
    kept_values = values.float().gather(2, top.unsqueeze(-1).expand(*top.shape, values.shape[-1]))
    out = torch.einsum("rkgn,rknd->rkgd", torch.softmax(kept_logits, dim=-1), kept_values)
    if not coverage:
        return out
    held = (probs.gather(-1, top.unsqueeze(2).expand(rows, num_kv, groups, top.shape[-1]))
            * usable.unsqueeze(2)).sum(-1)  # [rows, kv, groups]
    every = usable.sum(-1) == valid.sum(-1)  # nothing dropped: exactly 1, as the kernel gives
    return out, torch.where(every, 1.0, held.amin(dim=2).clamp(max=1.0))
