"""Per-page key bounds of a KV store, and the page rescue of the two-stage selection (issue 12).

A KV store's positions are cut into pages of ``page_tokens`` consecutive tokens; per page,
KV head and channel the store keeps the smallest and largest key written there
(``page_min``, ``page_max``: ``[batch, num_kv_heads, pages, head_dim]``, the keys' dtype, 0 for
a page with no written token). Quest (Tang et al., ICML 2024, section 3.2) bounds any query's
logit over a page by ``sum_c max(q_c * min_c, q_c * max_c)``.

The **page rescue** (option ``page_rescue``) uses the bounds inside each layer: before a
layer refines the step's speculative candidates with its own current query
(:func:`~.aten_step.refine_selection`), it adds the tokens of the ``rescue_pages`` pages with
the highest bound under that query. The lagged-query head picks the candidates from the
previous token's queries, once per step; what a layer's current query attends to that those
missed is what the rescue brings back (measured: docs/fidelity.md, "Page rescue"). Reading
the bounds costs ``2 / page_tokens`` of the keys' bytes per layer.

Everything here has static shapes and reads no tensor on the host, like :mod:`.aten_step`.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .sparse_attention import row_products, row_visibility

__all__ = ["PAGE_TOKENS", "clear_pages_from", "page_count", "page_positions", "page_scores", "rescued_candidates", "row_shift",
           "shift_from_mask", "update_page_bounds"]

PAGE_TOKENS = 16
_NEG = float("-inf")


def page_count(capacity: int, page_tokens: int) -> int:
    """Pages of a store of ``capacity`` slots: every row's pages may start ``page_tokens - 1``
    slots early (:func:`row_shift`), so one more page than ``ceil(capacity / page_tokens)``
    when ``page_tokens > 1``."""
    return -(-(capacity + page_tokens - 1) // page_tokens)


def row_shift(first_visible: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """int64 ``[batch]``: how far each row's pages are shifted so that its first real token
    (``first_visible``, the left padding's length) starts a page: page ``j`` of a row holds
    store positions ``j * page_tokens - shift .. (j + 1) * page_tokens - shift - 1``. A row
    then has the same pages (same tokens) as its prompt alone, and no page mixes pads with
    real tokens."""
    return (page_tokens - first_visible % page_tokens) % page_tokens


def _shift(shift: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """``[batch, 1, 1]`` int64 (zeros when no shift is kept)."""
    if shift is None:
        return torch.zeros(batch, 1, 1, dtype=torch.long, device=device)
    return shift.view(-1, 1, 1).expand(batch, 1, 1)


@has_side_effect
def update_after_write(key_cache: torch.Tensor, page_bounds: list[torch.Tensor], length: torch.Tensor,
                       key: torch.Tensor, page_tokens: int, page_shift: torch.Tensor | None = None) -> None:
    """The page-bounds half of ``specontext::kv_write``: after ``key`` ``[batch, num_kv_heads,
    q_len, head_dim]`` was written, :func:`update_page_bounds` of ``page_bounds`` =
    ``[page_min, page_max]`` for its ``q_len`` tokens (``[]``: the store keeps no bounds)."""
    if page_bounds:
        update_page_bounds(key_cache, page_bounds[0], page_bounds[1], length, key.shape[-2], page_tokens, page_shift)


def update_page_bounds(key_cache: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                       length: torch.Tensor, q_len: int, page_tokens: int,
                       page_shift: torch.Tensor | None = None) -> None:
    """Recompute, from the store, the bounds of every page a write of ``q_len`` tokens ending
    at ``length`` touched (the second half of ``specontext::kv_write``).

    A touched page is recomputed whole, over its positions ``< length`` only, so the bounds
    never depend on what a page held before (a crop, a reset or a rewrite leaves nothing
    stale). The number of pages recomputed is static, ``ceil((q_len - 1) / page_tokens) + 1``
    (at most every page); the window is shifted left at the store's end, so the page indices
    of a row are distinct and in range, and an extra page recomputed is recomputed exactly.

    Args:
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]``, after the write.
        page_min, page_max: ``[batch, num_kv_heads, pages, head_dim]``
            (:func:`page_count` pages), updated in place.
        length: int64 scalar tensor, tokens written including this write's.
        q_len: tokens of this write.
        page_tokens: tokens per page.
        page_shift: int64 ``[batch]`` per-row page shift (:func:`row_shift`), or None (0).
    """
    b, kv, capacity, d = key_cache.shape
    pages = page_min.shape[2]
    device = page_min.device  # an offloaded layer's store may be on the host: bounds stay here
    shift = _shift(page_shift, b, device)  # [b, 1, 1]
    touched = min(pages, -(-(q_len - 1) // page_tokens) + 1)
    first = ((length.to(device) - q_len + shift) // page_tokens).clamp(max=pages - touched).clamp(min=0)  # [b, 1, 1]
    page_ids = first + torch.arange(touched, device=device).view(1, touched, 1)  # [b, touched, 1]
    pos = page_ids * page_tokens - shift + torch.arange(page_tokens, device=device)  # [b, touched, P]
    valid = (pos >= 0) & (pos < length.to(device)) & (pos < capacity)
    index = pos.clamp(0, capacity - 1).view(b, 1, touched * page_tokens, 1).expand(b, kv, -1, d)
    keys = key_cache.gather(2, index.to(key_cache.device)).to(device).view(b, kv, touched, page_tokens, d)
    inside = valid.view(b, 1, touched, page_tokens, 1)
    lo = torch.where(inside, keys, float("inf")).amin(3)
    hi = torch.where(inside, keys, _NEG).amax(3)
    written = valid.any(-1).view(b, 1, touched, 1)
    # index_put_, not scatter_: inductor writes an index_put into a graph input in place
    # (its reinplace pass), while a scatter_ became a copy of the whole bounds, twice per bound
    # (4 x 395 KB per layer and step at 8K; benchmarks.layer_step --bounds)
    index = (torch.arange(b, device=device).view(b, 1, 1), torch.arange(kv, device=device).view(1, kv, 1),
             page_ids.view(b, 1, touched))
    page_min.index_put_(index, torch.where(written, lo, 0.0).to(page_min.dtype))
    page_max.index_put_(index, torch.where(written, hi, 0.0).to(page_max.dtype))


def clear_pages_from(page_min: torch.Tensor, page_max: torch.Tensor, length: int, page_tokens: int,
                     page_shift: torch.Tensor | None = None) -> None:
    """Zero the bounds of every page that starts at or after ``length`` (after a crop)."""
    b, _, pages, _ = page_min.shape
    start = page_positions(pages, page_tokens, page_shift, b, page_min.device)[..., :1]  # [b, 1, pages, 1]
    for bound in (page_min, page_max):
        bound.masked_fill_(start >= length, 0)


def page_positions(pages: int, page_tokens: int, page_shift: torch.Tensor | None, batch: int,
                   device) -> torch.Tensor:
    """int64 ``[batch, 1, pages, page_tokens]``: the store position of every slot of every page
    of each row (may be negative or past the store: not a position)."""
    shift = _shift(page_shift, batch, device).view(batch, 1, 1, 1)
    page = torch.arange(pages, device=device).view(1, 1, pages, 1)
    return page * page_tokens - shift + torch.arange(page_tokens, device=device)


def _seen_at(seen: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``seen`` ``[batch|1, 1, capacity]`` read at ``pos`` ``[batch, 1, ...]`` (False off the store)."""
    capacity = seen.shape[-1]
    inside = (pos >= 0) & (pos < capacity)
    flat = pos.clamp(0, capacity - 1).reshape(pos.shape[0], 1, -1)
    got = seen.expand(pos.shape[0], 1, capacity).gather(-1, flat).view(pos.shape)
    return got & inside


def page_scores(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, seen: torch.Tensor,
                scale: float, page_tokens: int, page_shift: torch.Tensor | None = None,
                fused: bool = False) -> torch.Tensor:
    """Quest's upper bound of each page's logit under this layer's query, per KV head.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        page_min, page_max: ``[batch, num_kv_heads, pages, head_dim]``.
        seen: bool ``[batch|1, 1, capacity]``: the positions some row of the step may attend
            to (written, causal limit, sliding window, mask); a page with none of them scores
            ``-inf``.
        scale: softmax scale, applied to the float32 query first (no product in half
            precision: field case ``fp16_logit_overflow``).
        page_tokens: tokens per page.
        page_shift: int64 ``[batch]`` per-row page shift (:func:`row_shift`) or None.
        fused: the products as fused reductions (``AttentionVariant.fused_products``).

    Returns:
        float32 ``[batch, num_kv_heads, pages]``: max over the KV group's query heads and the
        step's rows of ``sum_c max(q_c * min_c, q_c * max_c)``, computed as
        ``q+ . max + q- . min`` (``q+``/``q-`` the positive/negative parts). A soft cap
        (monotone) does not change the ranking.
    """
    b, num_kv, pages, d = page_min.shape
    q = (query.float() * scale).reshape(b, num_kv, -1, d)  # [b, kv, g * q_len, d]
    bound = row_products(q.clamp(min=0), page_max.float(), fused) + row_products(q.clamp(max=0), page_min.float(), fused)
    bound = bound.amax(2)  # [b, kv, pages]
    pos = page_positions(pages, page_tokens, page_shift, b, page_min.device)
    any_seen = _seen_at(seen, pos).any(-1)  # [b, 1, pages]
    return torch.where(any_seen, bound, _NEG)


def rescued_candidates(candidates: torch.Tensor, scores: torch.Tensor, seen: torch.Tensor, rescue_pages: int,
                       page_tokens: int, page_shift: torch.Tensor | None = None) -> torch.Tensor:
    """The candidates plus every seen token of the ``rescue_pages`` best pages by ``scores``.

    Args:
        candidates: int64 ``[batch, num_kv_heads, slots]`` ascending, ``-1`` padding first.
        scores: float32 ``[batch, num_kv_heads, pages]`` (:func:`page_scores`).
        seen: bool ``[batch|1, 1, capacity]`` as there: a rescued token must be one some
            row may attend to, so no pad position (or anything hidden) is added.
        rescue_pages: pages added per KV head (``<= pages``).
        page_tokens, page_shift: as :func:`page_scores`'.

    Returns:
        int64 ``[batch, num_kv_heads, slots + rescue_pages * page_tokens]``: the candidates
        unchanged (ascending, ``-1`` padding first), then the rescued tokens, ``-1`` where a
        rescued slot is unusable (not seen, or already a candidate), so no position appears
        twice. Not sorted as a whole (a sort per layer costs more than it buys): the first
        valid entries are still the candidates' sinks, which is all the refinement
        (:func:`~.aten_step.refine_gathered`) needs, and it sorts what it keeps.
    """
    b, num_kv, _ = candidates.shape
    capacity = seen.shape[-1]
    # which pages, not their order: an unsorted top-k
    pages = torch.where(torch.isfinite(scores), scores, _NEG).topk(rescue_pages, dim=-1, sorted=False)
    shift = _shift(page_shift, b, candidates.device).view(b, 1, 1, 1)
    offsets = torch.arange(page_tokens, device=candidates.device)
    tokens = (pages.indices[..., None] * page_tokens - shift + offsets).flatten(-2)  # [b, kv, rescue * P]
    usable = (pages.values > _NEG)[..., None].expand(-1, -1, -1, page_tokens).flatten(-2)
    usable = usable & _seen_at(seen, tokens.view(b, 1, -1)).view(b, num_kv, -1)
    tokens = tokens.clamp(0, capacity - 1)
    # candidates' membership as int32, not bool: inductor's CPU scatter into a bool tensor is
    # much slower (python -m benchmarks.layer_step --scatter)
    member = torch.zeros(b, num_kv, capacity + 1, dtype=torch.int32, device=candidates.device)
    member.scatter_(-1, torch.where(candidates >= 0, candidates, capacity), 1)
    usable = usable & (member.gather(-1, tokens) == 0)
    return torch.cat([candidates, torch.where(usable, tokens, -1)], dim=-1)


@has_side_effect
def shift_from_mask(page_shift: torch.Tensor, length: torch.Tensor, attn_mask: torch.Tensor | None, capacity: int,
                    page_tokens: int) -> None:
    """At a prompt's first write (``length`` == 0, tokens
    written before this step), set each row's page shift from its left padding, read from a
    full-attention site's Hugging Face mask (:func:`~.sparse_attention.row_visibility`; None = no
    padding: shift 0); later steps keep it. In place, on the device (a ``where``),
    ``page_shift`` int64 ``[batch]``."""

    if attn_mask is None:
        shift = torch.zeros_like(page_shift)
    else:
        visible = row_visibility(attn_mask, capacity)  # [b|1, 1, capacity]
        pads = (~visible[:, 0]).long().cumprod(-1).sum(-1)  # leading hidden positions per row
        shift = row_shift(pads, page_tokens).expand(page_shift.shape[0])
    page_shift.copy_(torch.where(length == 0, shift, page_shift))
