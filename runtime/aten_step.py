"""The decode step's functions as sync-free aten code: one implementation for eager and compiled runs.

Each function here is either a step function the pass calls directly (the selection nodes,
the per-layer refinement, the counters) or the body of one ``specontext::`` op (see
:mod:`.ops`: the cache's markers, the attention kernels), written so that
(1) it never reads a tensor value on the host — lengths, positions, causal limits and
selection sizes stay tensors, and value-dependent branches are data-parallel ``where``s —
and (2) it uses only aten ops with static shapes. Because of (1) a decode step can be
captured in a CUDA graph; because of (2) the backend can *lower* the ops into the graph
(:mod:`~specontext_compile.passes.lower`) so that inductor traces through them and fuses
them with the rest of the step instead of calling opaque Python ops.

Shapes are static: a selection always ranks every slot of the store (``capacity``), masking
positions that are not written yet, instead of slicing to the written length (which would
need the length on the host). Decisions that depend only on shapes (does the budget cover
the whole store?) are taken at trace time. The same graph runs eagerly (``inner="eager"``) or
under inductor: a direct call needs no op, no fake and no lowering.

Source: SpeContext (arXiv 2512.00722) section 4 (selection per KV head, GQA group max).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true as known
from torch.fx.node import has_side_effect

from . import cpu_kernels, cpu_refine, page_bounds  # noqa: F401 - cpu_kernels registers specontext::cpu_decode_attention
from .protocol import FALLBACK_STAT, GUARD_STAT
from .spec import AttentionVariant, StepSpec
from .split_store import split_chunks, split_store_attention
from .sparse_attention import (
    _gather_tokens,
    attend_gathered,
    causal_limit_mask,
    fused_products,
    row_visibility,
    selected_logits,
    sparse_attention_reference,
)

__all__ = ["count_fallback", "count_guard", "count_step", "covers_store",
           "attend_kept", "record_hidden", "record_query", "refine_and_attend", "refine_candidates", "refine_gathered", "refine_inputs",
           "refine_selection",
           "rescue_pages_into",
           "seen_positions", "select_positions",
           "sparse_attention",
           "sinks_attention", "write_kv"]

_NEG = float("-inf")


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, length: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor, checked: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[batch, num_kv_heads, q_len, head_dim]`` at positions
    ``length .. length+q_len-1`` of the stores ``[batch, num_kv_heads, capacity, head_dim]``
    (``index_copy_``, positions computed on the device) and advance ``length`` (int64 scalar
    tensor, tokens written) by ``q_len``. No capacity check: an out-of-range position is an
    index error of ``index_copy_`` (eager) or of the compiled kernel's bounds check.
    ``checked``: the int64 zero returned by ``specontext::check_capacity``, added to the
    positions so that the check runs first (data dependence)."""
    q_len = key.shape[-2]
    pos = length + torch.arange(q_len, device=length.device)
    if checked is not None:
        pos = pos + checked
    # cache state, not a differentiable value (as the opaque kv_write op): no autograd history
    # reaches the stores, whose later in-place writes would break a backward
    key_cache.index_copy_(2, pos, key.detach().to(key_cache.dtype))
    value_cache.index_copy_(2, pos, value.detach().to(value_cache.dtype))
    length.add_(q_len)


@has_side_effect
def count_step(stats: torch.Tensor, increments: list[int]) -> None:
    """``stats += increments`` (int64 path counters, see
    :data:`~specontext_compile.runtime.protocol.STATS`), on the device."""
    for i, step in enumerate(increments):  # python ints: no host-to-device copy
        if step:
            stats[i].add_(step)


@has_side_effect
def count_fallback(stats: torch.Tensor, ready: torch.Tensor) -> None:
    """Count a decode step whose selection head was not ready (``ready``: bool scalar tensor,
    :func:`.scorers.head_ready`), so its selection ranked by recency:
    ``stats[FALLBACK_STAT] += 1`` on the device (``recency_fallback_steps`` in
    ``path_counts()``), no host read."""
    stats[FALLBACK_STAT].add_((~ready).long())


@has_side_effect
def store_selection(selection_state: torch.Tensor, indices: torch.Tensor) -> None:
    """``selection_state[..., :slots] = indices`` (the step's selection, kept for the graphs
    after a graph break; ``[batch, kv, capacity]`` int64)."""
    selection_state[..., : indices.shape[-1]].copy_(indices)


def load_selection(selection_state: torch.Tensor, slots: int) -> torch.Tensor:
    """The first ``slots`` entries of the stored selection ``[batch, kv, slots]``."""
    return selection_state[..., :slots].clone()


@has_side_effect
def record_query(query_state: torch.Tensor, query_valid: torch.Tensor, query: torch.Tensor,
                 slot: int | torch.Tensor, length: torch.Tensor) -> None:
    """Keep the last query row of ``query`` ``[batch, num_heads, q_len, head_dim]`` in slot
    ``slot`` of ``query_state`` ``[slots, batch, num_heads, 1, head_dim]`` and stamp the slot
    in ``query_valid`` (int64 ``[slots]``) with ``length`` (int64 scalar: tokens written,
    this step's included). The next step may use the query only if it starts at exactly that
    length (:func:`.scorers.lagged_query_ready`): a query from before a crop, a reset or another
    prompt is never used. ``slot`` may be a 0-d int64 tensor instead of an int (regional
    compilation lifts it, so that every retrieval layer runs the same compiled region:
    specontext_compile/regional.py); the same copies then go through ``index_copy_``."""
    row = query[:, :, -1:, :].detach()  # selection state, not a differentiable value
    if isinstance(slot, torch.Tensor):
        index = slot.reshape(1)
        query_state.index_copy_(0, index, row.unsqueeze(0).to(query_state.dtype))
        query_valid.index_copy_(0, index, length.reshape(1).to(query_valid.dtype))
        return
    query_state[slot].copy_(row)
    query_valid[slot].copy_(length)


@has_side_effect
def record_hidden(aux_state: torch.Tensor, aux_valid: torch.Tensor, hidden: list[torch.Tensor],
                  length: torch.Tensor) -> None:
    """A fused draft head's input for later steps: the concatenated ``hidden`` (the auxiliary
    layers' outputs ``[batch, q_len, target_hidden]``, in ``aux_layer_ids`` order). In
    ``aux_state`` ``[batch, 1 + ROLLBACK_TOKENS, aux_width]``: row 0 the step's last row (what
    the next step reads), rows ``1 + p % ROLLBACK_TOKENS`` the step's last ``ROLLBACK_TOKENS``
    rows by position ``p``; ``aux_valid`` (int64 ``[1 + ROLLBACK_TOKENS]``) stamps each row
    ``p + 1``. ``length``: int64 scalar, tokens written *after* this step's (layer 0's, read
    after its write). The step after a rollback to any of these positions reads its entry
    (:func:`.draft_retrieval.previous_hidden`)."""
    history = aux_state.shape[1] - 1
    rows = torch.cat([h[:, -history:].detach() for h in hidden], -1).to(aux_state.dtype)  # [batch, kept, aux_width]
    kept = rows.shape[1]
    positions = length - kept + torch.arange(kept, device=length.device)
    entries = 1 + positions % history
    aux_state.index_copy_(1, entries, rows)
    aux_valid.index_copy_(0, entries, positions + 1)
    aux_state[:, :1].copy_(rows[:, -1:])
    aux_valid[:1].copy_(length.view(1))


def select_positions(scores: torch.Tensor, cached: torch.Tensor, q_len: int, slots: int, sink: int,
                     window: int, sliding_window: int = 0, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Pick ``slots`` positions per KV head: sinks + recent window + top-k of ``scores``.

    Computed with static shapes (the harness's host-side ``select_tokens``,
    benchmarks/host_selection.py, wraps it): every slot of the store is ranked, forced
    positions (the first ``sink`` visible ones, the last ``max(window, q_len)``) rank first
    (``+inf``), positions no query row of the step may see rank last (``-inf``) and come back
    as ``-1`` padding.

    Args:
        scores: ``[batch, num_kv_heads, capacity]`` float, higher = keep (values at
            positions ``>= cached`` are ignored).
        cached: int64 scalar tensor, tokens written before this step.
        q_len: tokens in this step (always selected).
        slots: selection size, ``<= capacity`` and ``>= q_len``.
        sink, window: always-kept first / last positions, counted in ``slots`` (the window
            is kept first when both do not fit).
        sliding_window: 0 = full attention; else only the positions the step's rows see
            (HF: ``q - w < p <= q``) are candidates, and no sinks are kept.
        visible: optional bool ``[batch|1, 1, capacity]`` (:func:`row_visibility`): positions
            a batch row may not attend to (left padding) are never selected, and the sinks
            and recent window are counted over the visible positions only (the sinks of a
            left-padded row are its first real tokens).

    Returns:
        int64 ``[batch, num_kv_heads, slots]`` ascending, ``-1`` padding first.

    Raises:
        ValueError: when ``slots < q_len`` or ``slots > capacity``.
    """
    b, num_kv, capacity = scores.shape
    if known(slots < q_len) or known(slots > capacity):
        raise ValueError(f"a selection of {slots} tokens must hold the step's {q_len} tokens and fit "
                         f"the store's {capacity} slots")
    pos = torch.arange(capacity, device=scores.device)
    total = cached + q_len
    start = (total - q_len - sliding_window + 1).clamp(min=0) if sliding_window > 0 else torch.zeros_like(total)
    seen = (pos >= start) & (pos < total)
    if visible is not None:
        seen = seen & visible
    recent = torch.sym_min(max(window, q_len), slots)
    sinks = 0 if sliding_window > 0 else torch.sym_min(sink, slots - recent)
    # sinks and window are counted over the positions the row sees: from the left and the right
    from_left = seen.cumsum(-1)
    from_right = seen.flip(-1).cumsum(-1).flip(-1)
    forced = seen & ((from_right <= recent) | (from_left <= sinks))
    rank = torch.where(seen, scores.float().nan_to_num(0.0), _NEG)
    rank = torch.where(forced, float("inf"), rank)
    values, top = rank.topk(slots, dim=-1, sorted=False)
    top = torch.where(values == _NEG, -1, top)
    return top.sort(dim=-1).values


def refine_selection(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor,
                     length: torch.Tensor, attn_mask: torch.Tensor | None, pages: Sequence[torch.Tensor | None],
                     spec: StepSpec, variant: AttentionVariant) -> tuple[torch.Tensor, torch.Tensor]:
    """Second stage of the two-stage selection: a layer keeps the ``spec.budget`` candidates its
    *own* query attends to most (the pass calls it in each refined layer, issue 12).

    The selection node picks ``candidates`` once per step, before the first layer, from the
    retrieval head (what offload prefetches); here, inside each layer, the layer's current
    query scores those candidates exactly as its attention will (``variant``: scale, soft
    cap, sliding window; causal limit, mask), the score of a candidate is the max over the
    query heads of its KV group and over the step's rows of the softmax weight among the
    candidates (the paper's GQA rule, section 4), and the top ``spec.budget`` are kept. The
    sinks (the first ``spec.sink_tokens`` valid candidates: the selection node forced them
    in, so they are the row's first visible tokens) and the recent window (positions ``>=
    length - max(spec.recent_window, q_len)``) are kept first, inside the budget, as in
    :func:`select_positions`. Static shapes, no host read.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]`` (this layer's).
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]``; MLA (:mod:`.mla`): the pair
            ``(latent_cache, rope_cache)`` of the layer's latent and rotary key stores, and
            ``query`` the absorbed query.
        candidates: int64 ``[batch, num_kv_heads, slots]`` ascending, ``-1`` padding first
            (a selection node's output). ``slots <= budget`` (a store whose capacity was
            symbolic when the pass ran) keeps every candidate.
        length: int64 scalar tensor, tokens written *including* this step's.
        attn_mask: the site's Hugging Face mask or None.
        pages: the page rescue's operands (:mod:`.page_bounds`): ``()`` (none) or
            ``(page_min, page_max, page_shift)``, the store's per-page key bounds ``[batch,
            num_kv_heads, pages, head_dim]`` and per-row page shift (int64 ``[batch]`` or
            None); before refining, the tokens of the ``spec.rescue_pages`` pages with the
            highest Quest bound under this layer's query join the candidates.
        spec: budget, sinks, recent window, the guard's ``min_coverage`` (0 = off: the site
            must run dense when any KV head's ``coverage`` (below) is under it; the pass
            counts that decision with :func:`count_guard`) and the page rescue
            (``rescue_pages``, ``page_tokens``).
        variant: the site's :class:`~.spec.AttentionVariant`.

    Returns:
        ``(indices, dense)``: int64 ``[batch, num_kv_heads, budget]`` in no particular order
        (``-1`` padding anywhere: attention reads a set, and a sort per layer is not free),
        and a bool scalar, True when the guard asks for dense attention
        (always False with the guard off). The guard's per-layer estimate, *coverage*, is
        per KV head the smallest (over the group's query heads and the step's rows)
        softmax mass among the candidates that the kept positions hold (1.0 = the
        candidates held nothing more); :func:`refine_coverage` returns it.

    Raises:
        ValueError: when ``spec.budget`` does not leave room for the step's ``q_len`` tokens.
    """
    indices, coverage = refine_coverage(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
    return indices, (coverage < spec.min_coverage).any()


@has_side_effect
def count_guard(stats: torch.Tensor, dense: torch.Tensor) -> None:
    """Count a site the fidelity guard sent dense (``dense``: :func:`refine_selection`'s bool
    scalar): ``stats[GUARD_STAT] += 1`` on the device (``guard_dense_sites`` in
    ``path_counts()``), no host read."""
    stats[GUARD_STAT].add_(dense.long())


def refine_coverage(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor,
                    length: torch.Tensor, attn_mask: torch.Tensor | None, spec: StepSpec,
                    variant: AttentionVariant, pages: Sequence[torch.Tensor | None] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_selection`'s kept positions and per-KV-head coverage estimate
    (float32 ``[batch, num_kv_heads]``), arguments as there.

    When the candidates have a slot for every position of the store (decided from shapes:
    option ``candidates=inf``, or a budget multiple that reaches the capacity) the keys are
    read in place, without a gather: the candidates are then every position the step's
    rows may see (causal limit, sliding window, visible in the mask), the same set the
    selection node returned, in position order. The kept set is then the gather path's, up
    to which of several exactly equal scores ``topk`` keeps. (Candidates plus rescued pages
    reaching the capacity do not count: the union is ranked as it is, so the same row gives
    the same kept set in stores of any size, e.g. padded or alone.)

    With the page rescue on (``spec.rescue_pages > 0`` and bounds given; never for MLA), the
    candidates become :func:`~.page_bounds.rescued_candidates` before the gather."""
    candidates, keys = refine_inputs(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
    return refine_gathered(query, keys, candidates, length, attn_mask, spec, variant)


def refine_inputs(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
                  attn_mask: torch.Tensor | None, spec: StepSpec, variant: AttentionVariant,
                  pages: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(candidates, keys)`` the refinement ranks (:func:`refine_coverage`, arguments as there):
    the positions of :func:`refine_candidates` (MLA: the candidates as given) and their keys
    ``[batch, num_kv_heads, slots, head_dim]``, gathered from the store, or the store itself,
    read in place, when the candidates have a slot for every store position."""
    key_cache, rope_cache = key_cache if isinstance(key_cache, tuple) else (key_cache, None)
    b, num_kv, capacity, _ = key_cache.shape
    if rope_cache is None:  # MLA ranks its candidates as they are (no page bounds, no in-place read)
        covers = known(candidates.shape[-1] >= capacity)
        candidates = refine_candidates(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
        if covers:
            return candidates, key_cache
    keys = _gather_tokens(key_cache, candidates.clamp(min=0))  # [b, kv, slots, d]
    if rope_cache is not None:
        keys = torch.cat([keys, _gather_tokens(rope_cache, candidates.clamp(min=0))], dim=-1)
    return candidates, keys


def refine_candidates(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
                      attn_mask: torch.Tensor | None, spec: StepSpec, variant: AttentionVariant,
                      pages: Sequence[torch.Tensor | None] = ()) -> torch.Tensor:
    """The positions a refinement ranks, int64 ``[batch, num_kv_heads, slots']``: every position
    the step's rows see (position order, ``-1`` elsewhere) when the candidates have a slot for
    every position of the ``[batch, num_kv_heads, capacity, head_dim]`` store (a static fact);
    else the candidates plus, with the page rescue on (``spec.rescue_pages > 0`` and
    ``pages`` given), the tokens of the rescued pages (:func:`rescue_pages_into`). Shared by
    the resident refinement and an offloaded layer's (:mod:`.offload_step`), which then read
    the keys of the same positions from different places."""
    b, num_kv, capacity, _ = key_cache.shape
    if known(candidates.shape[-1] >= capacity):
        pos = torch.arange(capacity, device=key_cache.device).expand(b, num_kv, capacity)
        seen = seen_positions(length, attn_mask, capacity, query.shape[2], variant.sliding_window, key_cache.device)
        return torch.where(seen, pos, -1)
    if spec.rescue_pages > 0 and pages:
        return rescue_pages_into(query, candidates, length, attn_mask, capacity, spec, variant, pages)
    return candidates


def rescue_pages_into(query: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
                      attn_mask: torch.Tensor | None, capacity: int, spec: StepSpec, variant: AttentionVariant,
                      pages: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The page rescue, shared by the resident refinement (:func:`refine_coverage`) and an
    offloaded layer's (:func:`.offload_step.refine`): the positions the step's rows
    see in a store of ``capacity`` slots (:func:`seen_positions`, on the bounds' device),
    Quest's bound per page under ``query`` (:func:`~.page_bounds.page_scores`), and the
    candidates plus the best ``spec.rescue_pages`` pages' seen tokens
    (:func:`~.page_bounds.rescued_candidates`). ``pages``: ``(page_min, page_max,
    page_shift)`` as in :func:`refine_selection`."""
    page_min, page_max, page_shift = pages
    device = page_min.device
    seen = seen_positions(length.to(device), attn_mask, capacity, query.shape[2], variant.sliding_window, device)
    scores = page_bounds.page_scores(query, page_min, page_max, seen, variant.scale, spec.page_tokens, page_shift,
                                     variant.fused_products)
    return page_bounds.rescued_candidates(candidates, scores, seen, torch.sym_min(spec.rescue_pages, page_min.shape[2]),
                                          spec.page_tokens, page_shift)


def seen_positions(length: torch.Tensor, attn_mask: torch.Tensor | None, capacity: int, q_len: int,
                   sliding_window: int, device: torch.device) -> torch.Tensor:
    """bool ``[batch|1, 1, capacity]``: the store positions some row of the step may attend to
    (causal limit from ``length``, tokens written with this step's; the sliding window; the
    mask's visible positions, :func:`row_visibility`)."""
    pos = torch.arange(capacity, device=device).view(1, 1, capacity)
    seen = causal_limit_mask(pos, length, q_len, sliding_window).any(dim=2)
    visible = row_visibility(attn_mask, capacity)
    return seen if visible is None else seen & visible


def refine_gathered(query: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
                    attn_mask: torch.Tensor | None, spec: StepSpec,
                    variant: AttentionVariant) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_coverage` once the candidates' keys ``[batch, num_kv_heads, slots,
    head_dim]`` are gathered (from the store, or from an offloaded layer's device buffer:
    :meth:`~.offload.OffloadManager.refine`); other arguments and the result as there. The
    candidates need not be sorted as a whole, only their first ``spec.sink_tokens`` valid
    entries must be the row's sinks (as a selection node's ascending output, or that output
    followed by more positions: :func:`~.page_bounds.rescued_candidates`)."""
    logits, probs, values, top = ranked(query, keys, candidates, length, attn_mask, spec, variant)
    allowed = logits > _NEG  # [b, kv, g, q, slots]
    # int32, not bool: inductor's CPU scatter into bool is much slower (benchmarks.layer_step --scatter)
    kept = torch.zeros_like(candidates, dtype=torch.int32).scatter_(-1, top, (values != _NEG).int())
    coverage = (probs * kept[:, :, None, None, :]).sum(-1)  # [b, kv, g, q]
    coverage = torch.where(allowed.any(-1), coverage, 1.0).amin(dim=(2, 3))
    indices = torch.where(values == _NEG, -1, candidates.gather(-1, top))
    return indices, coverage


def ranked(query, keys, candidates, length, attn_mask, spec: StepSpec, variant: AttentionVariant):
    """The refinement's ranking: ``(logits, probs, values, top)``, the candidates' logits and
    softmax ``[b, kv, g, q, slots]`` and the top-``budget`` rank values and slots ``[b, kv,
    budget]`` (a rank of ``_NEG``: no usable candidate in that slot)."""
    q_len = query.shape[2]
    budget = torch.sym_min(spec.budget, candidates.shape[-1])  # a budget above the candidates keeps them all
    if known(budget < q_len):
        raise ValueError(f"a refined selection of {budget} tokens cannot hold the step's {q_len} tokens")
    logits = selected_logits(query, keys, candidates, length, attn_mask, variant)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    score = probs.amax(dim=(2, 3))  # [b, kv, slots]
    valid = candidates >= 0
    recent = torch.sym_min(max(spec.recent_window, q_len), budget)
    sinks = 0 if variant.sliding_window > 0 else torch.sym_min(spec.sink_tokens, budget - recent)
    length = length.reshape(-1, 1, 1) if length.dim() else length
    forced = valid & ((valid.cumsum(-1) <= sinks) | (candidates >= length - recent))
    rank = torch.where(valid, score, _NEG)
    rank = torch.where(forced, float("inf"), rank)
    values, top = rank.topk(budget, dim=-1, sorted=False)
    return logits, probs, values, top


def refine_and_attend(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], candidates: torch.Tensor,
                      length: torch.Tensor, attn_mask: torch.Tensor | None, spec: StepSpec,
                      variant: AttentionVariant, pages: Sequence[torch.Tensor | None] = ()) -> torch.Tensor:
    """:func:`refine_selection` (guard off) then :func:`sparse_attention` over the kept tokens,
    in one body: the attention reuses the logits the refinement computed for the kept
    candidates instead of gathering their keys again and recomputing them (the same logits:
    :func:`~.sparse_attention.selected_logits` serves both). Only the kept tokens' values are
    gathered. The lowering (``passes/lower.py``) uses it for a refined site without the guard,
    learned sinks or the dense shortcut; ``store``: the layer's ``(key_cache, value_cache)``,
    other arguments as those two functions'. Returns
    ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype``. Its cost against the two
    bodies: ``python -m benchmarks.layer_step`` (docs/benchmarks.md).

    Where the pass chose our C++ kernel (``spec.cpu_kernel``: a CPU decode step inductor
    compiles, one query row per head, a site :func:`~.cpu_refine.applies` to), the ranking
    and the attention are :func:`~.cpu_refine.refine_attend`: the same kept set up to exactly
    equal ranks, float32 accumulation."""
    key_cache, value_cache = store
    if spec.cpu_kernel:  # the pass's decision (routes.cpu_kernel), read, never re-made
        candidates, pages = kernel_candidates(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
        return cpu_refine.refine_attend(query, store, candidates, length, kernel_visible(attn_mask, key_cache),
                                        spec, variant, pages)
    candidates, keys = refine_inputs(query, key_cache, candidates, length, attn_mask, spec, variant, pages)
    logits, _, values, top = ranked(query, keys, candidates, length, attn_mask, spec, variant)
    rows = _gather_tokens(value_cache, candidates.gather(-1, top).clamp(min=0))  # [b, kv, kept, dv]
    return attend_kept(query, logits, values, top, rows)


def kernel_candidates(query, key_cache, candidates, length, attn_mask, spec: StepSpec, variant: AttentionVariant,
                      pages) -> tuple[torch.Tensor, Sequence[torch.Tensor | None]]:
    """What the refine kernel is given at a site the pass chose it for (``spec.cpu_kernel``): ``(candidates,
    pages)``, the selection's candidates and the page bounds when the kernel rescues pages
    itself; else the positions ranked as they are (or every seen one, for a selection that
    covers the store) and no bounds."""
    if spec.rescue_pages > 0 and pages and not known(candidates.shape[-1] >= key_cache.shape[-2]):
        return candidates, pages
    return refine_candidates(query, key_cache, candidates, length, attn_mask, spec, variant), ()


def kernel_visible(attn_mask: torch.Tensor | None, key_cache: torch.Tensor) -> torch.Tensor | None:
    """The refine kernel's ``visible``: bool ``[batch|1, capacity]`` from the site's mask, or None."""
    visible = row_visibility(attn_mask, key_cache.shape[-2])
    return None if visible is None else visible[:, 0]


def attend_kept(query: torch.Tensor, logits: torch.Tensor, values: torch.Tensor, top: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
    """The attention half of :func:`refine_and_attend`: softmax over the refinement's logits
    ``[b, kv, groups, q_len, slots]`` (float32) at its kept slots ``top`` ``[b, kv, kept]``
    (rank ``values``: ``-inf`` = an empty slot, masked), times the kept tokens' value ``rows``
    ``[b, kv, kept, head_dim_v]`` (read from the store, or from an offloaded layer's device
    buffer). Returns ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype``."""
    b, num_kv, groups, q_len, _ = logits.shape
    kept = top.shape[-1]
    kept_logits = logits.gather(-1, top[:, :, None, None, :].expand(b, num_kv, groups, q_len, kept))
    kept_logits = kept_logits.masked_fill((values == _NEG)[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(kept_logits, dim=-1).nan_to_num(0.0).to(rows.dtype)
    out = torch.matmul(probs.view(b, num_kv, groups * q_len, kept), rows)
    return out.view(b, num_kv * groups, q_len, rows.shape[-1]).to(query.dtype)


def every_slot(key_cache: torch.Tensor) -> torch.Tensor:
    """int64 ``[batch, num_kv_heads, capacity]``: every slot of the store ``[batch,
    num_kv_heads, capacity, head_dim]`` (an expanded ``arange``): the selection of a site
    whose step makes none because it attends densely over the store (the pass's
    ``_selection_unused``)."""
    b, num_kv, capacity = key_cache.shape[:3]
    return torch.arange(capacity, device=key_cache.device).expand(b, num_kv, capacity)


def covers_store(indices: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when a selection has a slot for every position of the store (decided from
    shapes alone): it then holds every written position and attention is dense."""
    return known(indices.shape[-1] >= key_cache.shape[-2])


def _dense_store_attention(query, key_cache, value_cache, length, attn_mask, variant: AttentionVariant,
                           fused: bool = True, kernel: bool = False):
    """Exact attention over the whole store of a plain site (``variant.plain``) with the
    causal limit ``p <= length - q_len + r`` as a mask (unwritten slots hidden without
    reading ``length`` on the host).

    ``kernel`` (the pass's ``spec.cpu_kernel``, :func:`~.routes.cpu_kernel`): our CPU kernel
    (:func:`~.cpu_kernels.cpu_decode_attention`: each key and value loaded once for the
    group's rows). Else SDPA, except for a CPU decode step traced for inductor
    (``variant.fused_products``, which the lowering sets, and :func:`fused_products`: a few
    query rows per KV head): there, when the store is worth splitting for the threads
    (:func:`~.split_store.split_chunks`: a float32 store, few ``batch * num_kv_heads`` rows),
    :func:`~.split_store.split_store_attention`; else the gather path's body over every slot, read in place
    (:func:`attend_gathered` with the positions ``0 .. capacity-1``), which inductor compiles
    into one pass over the keys (the fused query-key products, softmax) and one ``bmm`` over
    the values: SDPA's CPU flash kernel at one query row read the store at a fraction of the
    copy rate (``python -m benchmarks.profile_decode --budget 16384``, docs/benchmarks.md,
    "How the step got here"). Both compute the same softmax in float32 (rounding apart).
    ``fused=False`` keeps SDPA: inside ``torch.cond``'s branch (the fidelity guard's dense
    branch) dynamo cannot trace the fused body's casts of functional tensors."""
    b, num_heads, q_len, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[-2]
    if kernel:
        visible = row_visibility(attn_mask, capacity)
        scaled, visible = query.float() * variant.scale, None if visible is None else visible[:, 0]
        # checked once here, on the traced values (the op's C++ kernel checks what guards memory)
        cpu_kernels.check_inputs(scaled, key_cache, value_cache, length, visible)
        return torch.ops.specontext.cpu_decode_attention(scaled, key_cache, value_cache, length,
                                                         visible).to(query.dtype)
    if fused and fused_products(query.reshape(b, num_kv, -1, head_dim), key_cache, variant.fused_products):
        chunks = split_chunks(b * num_kv, capacity, key_cache.dtype)
        if chunks > 1:
            return split_store_attention(query, key_cache, value_cache, length, attn_mask, variant, chunks)
        return attend_gathered(query, key_cache, value_cache, every_slot(key_cache), length, attn_mask, variant)
    scale = variant.scale
    rows = torch.arange(q_len, device=query.device).view(q_len, 1)
    length = length.reshape(-1, 1, 1, 1) if length.dim() else length
    allowed = torch.arange(capacity, device=query.device).view(1, capacity) <= length - q_len + rows
    if attn_mask is None:
        mask = allowed
    elif attn_mask.dtype == torch.bool:
        mask = allowed & attn_mask[..., :capacity]
    else:
        mask = torch.where(allowed, attn_mask[..., :capacity].to(query.dtype), float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key_cache, value_cache, attn_mask=mask, scale=scale,
        enable_gqa=query.shape[1] != key_cache.shape[1])
    return out.nan_to_num(0.0)


def optional_operands(*optional: torch.Tensor | None):
    """``torch.cond`` takes tensors only: the given ones of ``optional`` as a list, and a
    function turning a branch's trailing operands back into one value per slot (None where
    none was given)."""
    given = [t for t in optional if t is not None]

    def unpack(rest):
        rest = iter(rest)
        return tuple(next(rest) if t is not None else None for t in optional)

    return given, unpack


def guarded_attention(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], indices: torch.Tensor,
                      length: torch.Tensor, attn_mask: torch.Tensor | None, variant: AttentionVariant,
                      dense: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The fidelity guard's branch (``torch.cond``, traced by inductor as a conditional, not
    a graph break): exact dense attention over the layer's ``store = (key_cache,
    value_cache)`` when ``dense`` (bool scalar), else the gather path over ``indices``. Plain sites attend densely with SDPA over the store;
    soft-capped or sliding-window ones through the gather path over every slot (the same
    exact semantics). On CUDA the branch reads ``dense`` on the host (one sync per guarded
    site and step): the price of the guard, which is off by default."""
    key_cache, value_cache = store
    capacity = key_cache.shape[-2]
    plain = variant.plain and sinks is None
    extra, unpack = optional_operands(attn_mask, sinks)
    tensors = [query, key_cache, value_cache, indices, length] + extra

    def run_dense(q, k, v, idx, n, *rest):
        m, sk = unpack(rest)
        if plain:
            return _dense_store_attention(q, k, v, n, m, variant, fused=False)
        every = torch.arange(capacity, device=idx.device).expand(idx.shape[0], idx.shape[1], capacity)
        return sparse_attention_reference(q, k, v, every, n, m, variant, sk)

    def run_sparse(q, k, v, idx, n, *rest):
        m, sk = unpack(rest)
        return sparse_attention_reference(q, k, v, idx, n, m, variant, sk)

    return torch.cond(dense, run_dense, run_sparse, tuple(tensors))


def sinks_attention(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], indices: torch.Tensor,
                    length: torch.Tensor, attn_mask: torch.Tensor | None, variant: AttentionVariant,
                    sinks: torch.Tensor) -> torch.Tensor:
    """The attention of a site with learned sink logits ``sinks`` ``[num_heads]`` (GPT-OSS)
    over ``indices`` of its ``store = (key_cache, value_cache)``: the gather path of
    :func:`~.sparse_attention.sparse_attention_reference` (no kernel serves these sites, so
    the pass calls this directly instead of the op). Other arguments as :func:`sparse_attention`'s."""
    key_cache, value_cache = store
    return sparse_attention_reference(query, key_cache, value_cache, indices, length, attn_mask, variant, sinks)


def sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     indices: torch.Tensor, length: torch.Tensor, attn_mask: torch.Tensor | None,
                     spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """Attention of one layer over the selected tokens (``specontext::sparse_attention``,
    torch path), on the route the pass decided (``spec.route``, :func:`~.routes.decide`):
    ``"dense"``, exact attention over the whole store with the causal limit as a mask
    (contiguous reads; the selection has a slot for every store position, so it holds every
    written one); otherwise the gather path of
    :func:`~specontext_compile.runtime.sparse_attention.sparse_attention_reference` (shapes,
    mask and ``-1`` padding semantics there; scale, soft cap and sliding window from
    ``variant``). ``length`` counts this step's tokens. A site with the fidelity guard or
    learned sink logits is not this function's: the pass calls :func:`guarded_attention` or
    :func:`sinks_attention` for it.

    Raises:
        ValueError: ``spec.route == "dense"`` with a selection that does not cover the store
            or a site that is not plain (a spec built by hand: the pass never makes one).
    """
    if spec.route == "dense":
        if not (variant.plain and covers_store(indices, key_cache)):
            raise ValueError("StepSpec.route='dense' needs a plain site (no soft cap, no sliding window) whose "
                             "selection has a slot for every store position; use route='gather'")
        return _dense_store_attention(query, key_cache, value_cache, length, attn_mask, variant,
                                      kernel=spec.cpu_kernel)
    return sparse_attention_reference(query, key_cache, value_cache, indices, length, attn_mask, variant)
