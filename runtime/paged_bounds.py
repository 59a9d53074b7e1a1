"""Per-page key bounds over Hugging Face's paged cache, and the page rescue of the batched step (issue 28).

The one-request step's page rescue (:mod:`.page_bounds`, option ``page_rescue``) in a step of
Hugging Face's continuous batching (:mod:`.paged`). A request's tokens are cut into pages
of ``page_tokens`` consecutive tokens from its first, as one request's store is; the engine
keeps a request's tokens in blocks of ``block_tokens`` (its ``page_size``), so when
``page_tokens`` divides ``block_tokens`` every page lies inside one block, at rows
``page_tokens``-aligned there: a page is a *physical* unit of the cache
(:func:`physical_page`), and its bounds live with it, like the lagged queries live with
their blocks.

* **Bounds are recomputed, never accumulated** (:func:`write_plan`, :func:`update_bounds`):
  after a layer's KV write, the bounds of every page a row of the step wrote are recomputed
  from the cache over the page's rows up to the last one written. A request writes its
  tokens in order, so those rows are all its own: a page freed and reused by another
  request never mixes the two (its first row written starts it over), and no lifecycle of
  ours is needed. The bounds of a page then equal the one-request store's bounds of the
  same page (its positions below the length), which is what makes a batched request
  select as it does alone.
* **The rescue** (:func:`rescue_plan` once per step, :func:`packed_rescue` per layer): per
  decode row and KV head, Quest's bound of each
  of its request's pages under the layer's query (:func:`~.page_bounds.page_scores`'
  formula), the best ``spec.rescue_pages`` pages' tokens appended to the row's candidates
  (those already candidates, or past the row's own token, as ``-1``), as
  :func:`~.page_bounds.rescued_candidates` does; the layer then keeps its ``budget`` of them
  (:func:`~.paged.packed_refine_attention`).

Blocks the engine copies outside the step (a request forked for parallel sampling gets a
copy of its parent's last, partly written block) get their bounds copied with them
(:meth:`~.paged.PagedState.copy_blocks`, hooked into the engine's copy by
``specontext_compile.serving``).

Everything here has static shapes and reads no tensor on the host.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .spec import StepSpec

__all__ = ["PagedLayout", "RescuePlan", "WritePlan", "packed_rescue", "page_rows", "physical_page", "rescue_plan",
           "update_bounds", "write_plan"]

_NEG = float("-inf")


class PagedLayout(NamedTuple):
    """Hugging Face's paged cache as the views' shapes show it: ``page_size`` tokens per block
    (the engine's ``page_size``), ``layers`` per block, ``stride = 2 * page_size * layers``
    rows per block of a layer's view, ``blocks`` blocks (the engine's trash sectors included).
    A named tuple: graph code prints it back as a constructor call."""

    page_size: int
    layers: int
    blocks: int

    @property
    def stride(self) -> int:
        return 2 * self.page_size * self.layers

    def pages(self, page_tokens: int) -> int:
        """Pages of ``page_tokens`` tokens the cache holds (``page_tokens`` divides ``page_size``)."""
        return self.blocks * (self.page_size // page_tokens)


def physical_page(rows: torch.Tensor, layout: PagedLayout, page_tokens: int) -> torch.Tensor:
    """int64, the page of each physical row of a layer's view (``rows`` int64, any shape):
    block ``rows // stride``, then the ``page_tokens``-aligned unit of its offset."""
    return (rows // layout.stride) * (layout.page_size // page_tokens) + (rows % layout.stride) // page_tokens


def page_rows(page_start: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """``[..., page_tokens]``: the rows (or packed columns) of pages starting at ``page_start``."""
    return page_start.unsqueeze(-1) + torch.arange(page_tokens, device=page_start.device)


@dataclasses.dataclass
class WritePlan:
    """Which pages a step's KV write touched (:func:`write_plan`), shared by every layer.

    Attributes:
        rows: int64 ``[Q, page_tokens]``: for each query row, the physical rows of its page
            from the page's first row on.
        written: bool ``[Q, page_tokens]``: those up to the row's own (written by its request).
        target: int64 ``[Q]``: the page each row's bounds go to: its page when it is the last
            real row of the step writing there, else the scratch entry (last).
    """

    rows: torch.Tensor
    written: torch.Tensor
    target: torch.Tensor


def write_plan(write_index: torch.Tensor, attn_mask: torch.Tensor, layout: PagedLayout, pages: int,
               page_tokens: int) -> WritePlan:
    """The pages the step's rows write (``write_index`` int64 ``[Q]``; Hugging Face's mask
    ``[1, 1, Q, KV]`` tells the rows of requests from padding, :func:`~.paged.packed_rows`) in
    a cache of ``pages`` pages of ``page_tokens`` tokens. Rows of one request are consecutive
    and in token order, so the last row writing a page has every row the step wrote there
    below it."""
    from .paged import packed_rows, packed_visible

    real = packed_rows(packed_visible(attn_mask))[0]
    rows = write_index.long()
    offset = rows % layout.stride % page_tokens
    start = rows - offset
    span = page_rows(start, page_tokens)  # [Q, P]
    written = torch.arange(page_tokens, device=rows.device) <= offset.unsqueeze(-1)
    page = physical_page(rows, layout, page_tokens)
    same_next = torch.cat([(page[1:] == page[:-1]) & real[1:], real.new_zeros(1)])
    target = torch.where(real & ~same_next, page, pages)
    return WritePlan(span, written & real.unsqueeze(-1), target)


def update_bounds(bounds: tuple[torch.Tensor, torch.Tensor], key_view: torch.Tensor, plan: WritePlan) -> None:
    """Recompute, after a layer's KV write, the bounds of the pages ``plan`` names.

    Args:
        bounds: the layer's ``(page_min, page_max)`` ``[pages + 1, num_kv_heads, head_dim]``
            (entry ``pages`` is scratch), updated in place.
        key_view: the layer's key view ``[rows, num_kv_heads, head_dim]``, after the write.
        plan: :func:`write_plan`.
    """
    page_min, page_max = bounds
    keys = key_view[plan.rows.clamp(0, key_view.shape[0] - 1)]  # [Q, P, Hkv, D]
    inside = plan.written[..., None, None]
    lo = torch.where(inside, keys, float("inf")).amin(1)
    hi = torch.where(inside, keys, _NEG).amax(1)
    some = plan.written.any(-1)[:, None, None]
    page_min.index_copy_(0, plan.target, torch.where(some, lo, 0.0).to(page_min.dtype))
    page_max.index_copy_(0, plan.target, torch.where(some, hi, 0.0).to(page_max.dtype))


@dataclasses.dataclass
class RescuePlan:
    """What the page rescue reads from the step, not from a layer (:func:`rescue_plan`, once
    per step; every layer's :func:`packed_rescue` shares it).

    Attributes:
        starts: int64 ``[Pg]``: the packed column of each page's first token (``-1`` unused),
            ``Pg = ceil(KV / page_tokens) + Q`` (a static bound on the step's pages).
        page: int64 ``[Pg]``: each page's physical page (:func:`physical_page`).
        mine: bool ``[Q, Pg]``: the pages of each row's request up to its own token.
        own: int64 ``[Q]``: each row's own column (``-1``: a padding row).
        member: int32 ``[Q, num_kv_heads, KV + 1]``: 1 at the step's candidates (the rescue
            adds no column twice).
    """

    starts: torch.Tensor
    page: torch.Tensor
    mine: torch.Tensor
    own: torch.Tensor
    member: torch.Tensor


def rescue_plan(columns: torch.Tensor, read_index: torch.Tensor, attn_mask: torch.Tensor, page_tokens: int,
                layout: PagedLayout) -> RescuePlan:
    """The step's :class:`RescuePlan`. A request's pages start at its first column (its first
    token), every ``page_tokens`` columns, as one request's store's pages do.

    Args:
        columns: int64 ``[Q, num_kv_heads, slots]``, the step's candidates
            (:func:`~.paged.packed_select`; ``-1`` = none).
        read_index: int64 ``[KV]``: each packed column's physical row.
        attn_mask: the rows' mask ``[1, 1, Q, KV]`` (Hugging Face's, or a mixed step's decode
            rows': :func:`~.paged.decode_subset`).
        page_tokens: tokens per page.
        layout: the cache's :class:`PagedLayout`.
    """
    from .paged import packed_rows, packed_visible

    visible = packed_visible(attn_mask)  # [Q, 1, KV]
    real, _, first, own = packed_rows(visible)
    seen = visible[:, 0]
    q_rows, kv = seen.shape
    cols = torch.arange(kv, device=seen.device)
    col_first = torch.where(seen, first.unsqueeze(-1), -1).amax(0)  # [KV]: its request's first column
    is_start = (col_first >= 0) & ((cols - col_first) % page_tokens == 0)
    starts = torch.nonzero_static(is_start, size=-(-kv // page_tokens) + q_rows, fill_value=-1).view(-1)
    page = physical_page(read_index.long()[starts.clamp(min=0)], layout, page_tokens)
    mine = real.unsqueeze(-1) & (starts >= first.unsqueeze(-1)) & (starts <= own.unsqueeze(-1))  # [Q, Pg]
    member = torch.zeros(q_rows, columns.shape[1], kv + 1, dtype=torch.int32, device=columns.device)
    member.scatter_(-1, torch.where(columns >= 0, columns, kv), 1)
    return RescuePlan(starts, page, mine, torch.where(real, own, -1), member)


def packed_rescue(query: torch.Tensor, columns: torch.Tensor, plan: RescuePlan,
                  bounds: tuple[torch.Tensor, torch.Tensor], spec: StepSpec, scale: float) -> torch.Tensor:
    """The candidates of each decode row plus the tokens of its request's best pages.

    Per row and KV head, Quest's bound ``q+ . max + q- . min`` of each page of the row's
    request under the layer's float32 query times ``scale``, max over the KV group's query
    heads (as :func:`~.page_bounds.page_scores`); the ``spec.rescue_pages`` best pages' tokens
    join the candidates unless already there or past the row's own token (as
    :func:`~.page_bounds.rescued_candidates`). Every row's pages are ranked in one product,
    each row among its own request's only (``plan.mine``).

    Args:
        query: ``[1, num_heads, Q, head_dim]`` (the layer's, after RoPE).
        columns: int64 ``[Q, num_kv_heads, slots]``, the step's candidates (as
            :func:`rescue_plan` got them).
        plan: :func:`rescue_plan`.
        bounds: the layer's ``(page_min, page_max)`` (:func:`update_bounds`).
        spec: ``rescue_pages``, ``page_tokens``.
        scale: the layer's softmax scale.

    Returns:
        int64 ``[Q, num_kv_heads, slots + min(rescue_pages, Pg) * page_tokens]``: the
        candidates as given, then the rescued columns (``-1`` where unusable); no column twice.
    """
    tokens = spec.page_tokens
    page_min, page_max = bounds[0][plan.page].float(), bounds[1][plan.page].float()  # [Pg, Hkv, D]
    q_rows, pages = plan.mine.shape
    num_kv, d = page_min.shape[1], page_min.shape[2]
    q = (query[0].float() * scale).transpose(0, 1).reshape(q_rows, num_kv, -1, d).transpose(0, 1)  # [Hkv, Q, g, D]
    q = q.reshape(num_kv, -1, d)
    bound = q.clamp(min=0) @ page_max.permute(1, 2, 0) + q.clamp(max=0) @ page_min.permute(1, 2, 0)
    bound = bound.view(num_kv, q_rows, -1, pages).amax(2).transpose(0, 1)  # [Q, Hkv, Pg]
    bound = torch.where(plan.mine.unsqueeze(1), bound, _NEG)
    best = bound.topk(torch.sym_min(spec.rescue_pages, pages), dim=-1, sorted=False)
    rescued = page_rows(plan.starts[best.indices], tokens).flatten(-2)  # [Q, Hkv, R * P]
    usable = (best.values > _NEG).unsqueeze(-1).expand(-1, -1, -1, tokens).flatten(-2)
    usable = usable & (rescued <= plan.own.view(-1, 1, 1))
    rescued = rescued.clamp(0, plan.member.shape[-1] - 2)
    usable = usable & (plan.member.gather(-1, rescued) == 0)
    return torch.cat([columns, torch.where(usable, rescued, -1)], dim=-1)
