"""Sparse decode over a paged, packed KV cache: Hugging Face's continuous batching (issue 28).

Hugging Face's continuous-batching engine (transformers 5.x, ``generate_batch``,
``transformers serve --continuous-batching``) packs every request of a step into one row of
``Q`` query tokens. Per layer it writes the step's keys and values into a paged cache at
``write_index`` and gathers every request's whole history at ``read_index`` into ``KV``
packed columns; a block-diagonal additive mask ``[1, 1, Q, KV]`` keeps each query row inside
its own request (causal). This module is the step our pass (``passes/paged.py``) puts in
that graph, with the same selection as the one-request step (SpeContext section 4):

* **what a row sees comes from the mask alone**: the visible columns of a row are its
  request's, its last visible column is its own token, the one before it the request's
  previous token; a row is a request's last row when the next row starts a different
  request (:func:`packed_rows`);
* **lagged queries live with the pages**: each retrieval layer records, for every request's
  last row, its query in the *block* of the cache that holds that token, stamped with the
  token's physical row (:func:`record_packed_query`). The next step reads the block of the
  request's previous token and uses the query only when the stamp matches. Blocks are freed
  and reused with their requests, so the state needs no lifecycle of its own, and a stale
  query from a block's previous owner never matches (its stamp is another token's row, or
  the owner's query was overwritten when this request wrote its token);
* **a step whose rows all decode** (every request one query token: :func:`is_decode_step`)
  attends sparsely: per row and KV head, sinks + recent window + the top of the
  lagged-query scores (:func:`packed_select`, the same :func:`~.aten_step.select_positions`
  as the one-request step), gathered from the paged cache through ``read_index``
  (:func:`packed_sparse_attention`). A step of prefill chunks only runs Hugging Face's own
  graph (dense, exact), with the recording added; a *mixed* step (some requests decode,
  others prefill) attends sparsely on its decode rows and densely on the others
  (:func:`mixed_attention`), so a request decodes the same whatever shares its steps. The
  backend compiles the three variants and picks one per step on the host
  (:func:`classify_step`);
* **a one-row request is not always a decode token**: a chunked prefill may leave one prompt
  token alone in a step. The step function tells them apart from the engine's
  ``logits_to_keep`` (whose rows' next tokens it samples), recorded per block after each
  step (:func:`record_generated`, :func:`decoding_rows`), and runs such a token as prefill.

Layout (``runtime/README.md``): a layer's key view ``[rows, num_kv_heads, head_dim]`` is the
cache tensor from that layer's first row on; the token in block ``b`` at offset ``o`` is row
``b * stride + o`` of every layer's view, ``stride = 2 * page_size * layers``.
"""

from __future__ import annotations

import dataclasses

import torch

from .aten_step import select_positions
from .sparse_attention import group_max_probs, query_key_logits
from .spec import StepSpec

__all__ = ["DENSE", "MIXED", "PAGED_STATS", "SPARSE", "PagedState", "count_paged_step", "decode_rows",
           "classify_step", "decode_subset", "decoding_rows", "expand_decode_rows", "record_generated",
           "sampled_rows",
           "is_decode_step", "last_rows", "mask_rows", "mixed_attention", "packed_rows", "packed_select",
           "packed_refine_attention", "packed_sparse_attention", "packed_visible", "record_packed_query", "step_kind"]

_NEG = float("-inf")

#: Counters a :class:`PagedState` keeps (index = position), advanced on the device.
PAGED_STATS = (
    "steps",             # steps the rewritten graph ran
    "sparse_steps",      # ... of which every row decoded: sparse attention at every site
    "dense_steps",       # ... of which no row decoded (prefill chunks only): dense and exact
    "mixed_steps",       # ... of which decode rows attended sparsely, prefill rows densely
    "sparse_sites",      # attention calls over a selection (sites x sparse and mixed steps)
    "recency_rows",      # decode rows whose selection ranked by recency (no lagged query recorded)
    "refined_sites",     # ... of the sparse_sites, those that kept their own budget of the candidates
    "one_token_chunks",  # one-row requests still prefilling: attended densely, as prefill (decoding_rows)
    "rescued_sites",     # ... of the refined_sites, those whose candidates took in rescued pages (paged_bounds)
)
DENSE, SPARSE, MIXED = 0, 1, 2  # kinds of step (:func:`step_kind`)


@dataclasses.dataclass
class PagedState:
    """The lagged queries of one paged cache (one per cache: two engines never share one).

    Attributes:
        queries: ``[retrieval_layers, blocks + 1, num_heads, head_dim]`` float32; entry
            ``blocks`` is scratch (rows that record nothing write there).
        stamps: int64 ``[retrieval_layers, blocks + 1]``: the physical row of the token each
            entry's query was recorded at (-1 = never).
        stats: int64 ``[len(PAGED_STATS)]``.
        generated: int64 ``[blocks + 1]``: per block, the physical row of the last request
            row recorded there whose next token the engine sampled (-1: the row ended a
            prefill chunk with more to come), kept by the step function on the host side
            (:func:`record_generated`, :func:`decoding_rows`); not a graph input.
        page_min, page_max: the page rescue's per-page key bounds ``[layers, pages + 1,
            num_kv_heads, head_dim]`` in the keys' dtype (entry ``pages`` is scratch;
            :mod:`.paged_bounds`), or empty when the step keeps none
            (:meth:`allocate_bounds`).
    """

    queries: torch.Tensor
    stamps: torch.Tensor
    stats: torch.Tensor
    generated: torch.Tensor
    page_min: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0))
    page_max: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0))
    stride: int = 0  # rows per block of a layer's view (:class:`~.paged_bounds.PagedLayout`)
    pages_per_block: int = 0  # bounds pages per block (0: no bounds kept)

    def copy_blocks(self, source: list[int], dest: list[int]) -> None:
        """What Hugging Face's engine does to the cache when it forks a request (parallel
        sampling: ``num_return_sequences`` > 1), done to the state: block ``dest[i]`` gets the
        lagged queries, page bounds and sampled-row records of block ``source[i]``, their
        rows moved to the new block, so that the copy selects as the original. The engine
        copies whole blocks outside the step (``PagedAttentionCache.perform_cache_copy``),
        which the compiled step never sees: without this, a forked request's copied pages kept
        the bounds of the block's former contents and it decoded otherwise than its parent
        (tested)."""
        src = torch.tensor(source, dtype=torch.long, device=self.stamps.device)
        dst = torch.tensor(dest, dtype=torch.long, device=self.stamps.device)

        def moved(rows: torch.Tensor) -> torch.Tensor:  # rows [n, ...] of block src[i], now in dst[i] (else -1)
            shape = (-1,) + (1,) * (rows.dim() - 1)
            start, into = src.view(shape) * self.stride, dst.view(shape) * self.stride
            inside = (rows >= start) & (rows < start + self.stride)
            return torch.where(inside, rows - start + into, -1)

        self.queries[:, dst] = self.queries[:, src]
        self.stamps[:, dst] = moved(self.stamps[:, src].transpose(0, 1)).transpose(0, 1)
        self.generated[dst] = moved(self.generated[src])
        if self.pages_per_block:
            unit = self.pages_per_block
            pages = (src.view(-1, 1) * unit + torch.arange(unit, device=src.device)).view(-1)
            into = (dst.view(-1, 1) * unit + torch.arange(unit, device=src.device)).view(-1)
            self.page_min[:, into] = self.page_min[:, pages]
            self.page_max[:, into] = self.page_max[:, pages]

    @classmethod
    def allocate(cls, layers: int, blocks: int, num_heads: int, head_dim: int, device) -> PagedState:
        """Zero queries, stamps -1 (nothing recorded), zero counters."""
        return cls(torch.zeros(layers, blocks + 1, num_heads, head_dim, device=device),
                   torch.full((layers, blocks + 1), -1, dtype=torch.long, device=device),
                   torch.zeros(len(PAGED_STATS), dtype=torch.long, device=device),
                   torch.full((blocks + 1,), -1, dtype=torch.long, device=device))

    def allocate_bounds(self, layers: int, pages: int, key_view: torch.Tensor) -> None:
        """Zero bounds for ``pages`` pages of every one of ``layers`` layers, shaped and typed as
        the keys of ``key_view`` ``[rows, num_kv_heads, head_dim]``."""
        shape = (layers, pages + 1, *key_view.shape[1:])
        self.page_min = key_view.new_zeros(shape)
        self.page_max = key_view.new_zeros(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the state's tensors (what the step keeps beside the engine's KV cache)."""
        return sum(t.numel() * t.element_size() for t in (*self.tensors(), self.generated))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The graph inputs the pass appends (queries, stamps, counters, page_min, page_max)."""
        return self.queries, self.stamps, self.stats, self.page_min, self.page_max

    def counts(self) -> dict[str, int]:
        """The counters by name (one host read)."""
        return dict(zip(PAGED_STATS, self.stats.tolist()))


def packed_visible(attn_mask: torch.Tensor) -> torch.Tensor:
    """bool ``[Q, 1, KV]``: the packed columns each query row may attend to, read from Hugging
    Face's additive mask ``[1, 1, Q, KV]`` (0 = visible, the dtype's minimum = hidden) or a
    bool mask (True = visible)."""
    mask = attn_mask[0, 0]
    if mask.dtype == torch.bool:
        return mask.unsqueeze(1)
    return (mask > torch.finfo(mask.dtype).min / 2).unsqueeze(1)


def packed_rows(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row, from its visible columns ``[Q, 1, KV]``: ``(real, last, first, own)``.

    ``real`` bool ``[Q]``: the row sees something (padding rows see nothing); ``first`` /
    ``own`` int64 ``[Q]``: its first and last visible column (its request's first token and its
    own token); ``last`` bool ``[Q]``: the row is its request's last row (the next row starts
    another request or is padding), so its query is the one the next step's selection uses.
    A decode step is one whose real rows are all last rows (:func:`is_decode_step`)."""
    seen = visible[:, 0]
    q_rows, kv = seen.shape
    cols = torch.arange(kv, device=seen.device)
    real = seen.any(-1)
    first = torch.where(seen, cols, kv).amin(-1)
    own = torch.where(seen, cols, -1).amax(-1)
    nxt = torch.cat([first[1:], first.new_full((1,), -1)])
    nxt_real = torch.cat([real[1:], real.new_zeros(1)])
    last = real & ~(nxt_real & (nxt == first))
    return real, last, first, own


def record_packed_query(queries: torch.Tensor, stamps: torch.Tensor, slot: int, query: torch.Tensor,
                        write_index: torch.Tensor, last: torch.Tensor, stride: int) -> None:
    """Retrieval layer ``slot`` keeps each request's last query row in the block of the token
    that row wrote (``write_index // stride``), stamped with that token's physical row; other
    rows write the scratch entry. In place on ``queries`` / ``stamps`` (:class:`PagedState`).

    Args:
        query: ``[1, num_heads, Q, head_dim]`` (the layer's attention query, after RoPE).
        write_index: int64 ``[Q]``: each row's token's physical row.
        last: bool ``[Q]`` (:func:`packed_rows`).
        stride: rows per block of the layer views.
    """
    scratch = queries.shape[1] - 1
    block = torch.where(last, write_index // stride, scratch)
    rows = query[0].transpose(0, 1).detach().to(queries.dtype)  # [Q, H, D]
    queries[slot].index_copy_(0, block, rows)
    stamps[slot].index_copy_(0, block, torch.where(last, write_index, -1))


def packed_select(queries: torch.Tensor, stamps: torch.Tensor, key_views: list[torch.Tensor],
                  read_index: torch.Tensor, attn_mask: torch.Tensor, spec: StepSpec, scale: float,
                  stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's selection, per query row and KV head, over the packed columns.

    Scores (as :func:`~.scorers.lagged_query_score`, per row): for each retrieval layer
    ``i`` the softmax of its recorded query (the request's previous token's) against its
    keys over the row's visible columns except its own token, max over the query heads of
    each KV group, summed over the layers; a row whose request has no matching record
    (stamp) ranks by recency (the column). Then :func:`~.aten_step.select_positions` over the
    row's visible columns: sinks (its first), recent window (its last, its own token
    included), the top of the scores; ``min(spec.candidate_slots, KV)`` slots.

    Args:
        queries, stamps: the cache's :class:`PagedState` tensors.
        key_views: the retrieval layers' key views ``[rows, num_kv_heads, head_dim]``, in
            slot order (read before this step's writes: only past tokens are scored).
        read_index: int64 ``[KV]``: each packed column's physical row.
        attn_mask: Hugging Face's mask ``[1, 1, Q, KV]``.
        spec: budget (``candidate_slots``), ``sink_tokens``, ``recent_window``.
        scale: the retrieval layers' softmax scale.
        stride: rows per block.

    Returns:
        ``(columns, recency, last, decode)``: int64 ``[Q, num_kv_heads, slots]`` packed
        columns (ascending, ``-1`` padding first); int64 scalar, the decode rows ranked by
        recency; bool ``[Q]``, the requests' last rows (:func:`packed_rows`), whose queries
        the retrieval layers record; bool ``[Q]``, the decode rows (:func:`decode_rows`).
    """
    visible = packed_visible(attn_mask)
    real, last, first, own = packed_rows(visible)
    q_rows, kv = visible.shape[0], visible.shape[-1]
    cols = torch.arange(kv, device=visible.device)
    previous = own - 1
    has_previous = real & (previous >= first)
    prev_row = read_index[previous.clamp(min=0)]
    block = (prev_row // stride).clamp(max=queries.shape[1] - 1)
    ready = has_previous & (stamps[:, block] == prev_row).all(0)  # [Q]
    scored = visible & (cols != own.view(-1, 1, 1))  # past tokens of the row's request
    total = None
    for i, view in enumerate(key_views):
        keys = view.index_select(0, read_index).transpose(0, 1)  # [Hkv, KV, D]
        num_kv, _, d = keys.shape
        q = queries[i, block].view(q_rows, num_kv, -1, d)  # [Q, Hkv, g, D]
        groups = q.shape[2]
        q = q.permute(1, 0, 2, 3).reshape(num_kv, q_rows * groups, d)
        logits = query_key_logits(q, keys, scale).view(num_kv, q_rows, groups, kv).permute(1, 0, 2, 3)
        probs = group_max_probs(logits, scored)  # [Q, Hkv, KV]: the selection heads' own weights
        total = probs if total is None else total + probs
    recency = cols.to(torch.float32).expand_as(total)
    scores = torch.where(ready.view(-1, 1, 1), total, recency)
    slots = torch.sym_max(1, torch.sym_min(spec.candidate_slots, kv))
    everything = torch.full((), kv, dtype=torch.long, device=visible.device)
    columns = select_positions(scores, everything - 1, 1, slots, spec.sink_tokens, spec.recent_window, 0, visible)
    decode = decode_rows(real, last, first)
    recency_rows = (decode & ~ready).sum()
    return columns, recency_rows, last, decode


def count_paged_step(stats: torch.Tensor, kind: int, sites: int, recency_rows: torch.Tensor | None = None,
                     spec: StepSpec | None = None) -> None:
    """Advance :data:`PAGED_STATS` for one step of ``kind`` (:data:`DENSE`, :data:`SPARSE`,
    :data:`MIXED`) with ``sites`` attention sites (``recency_rows`` from
    :func:`packed_select`; None for a dense step; ``spec``: the sites' step spec, whose
    ``refines`` says each site refines the candidates, :func:`packed_refine_attention`,
    and ``rescue_pages`` that they take in rescued pages first,
    :func:`~.paged_bounds.packed_rescue`), on the device."""
    recency = stats.new_zeros(()) if recency_rows is None else recency_rows.to(stats.dtype)
    sparse = sites * (kind != DENSE)
    refined = sparse * bool(spec is not None and spec.refines)
    rescued = sparse * bool(spec is not None and spec.rescue_pages > 0)
    counts = stats.new_tensor([1, kind == SPARSE, kind == DENSE, kind == MIXED, sparse])
    stats.add_(torch.cat([counts, recency.view(1), stats.new_tensor([refined, 0, rescued])]))


def last_rows(attn_mask: torch.Tensor) -> torch.Tensor:
    """bool ``[Q]``: the requests' last query rows (:func:`packed_rows`) of Hugging Face's mask."""
    return packed_rows(packed_visible(attn_mask))[1]


def decode_rows(real: torch.Tensor, last: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """bool ``[Q]``: rows that are their request's only query row this step (a decode token,
    or a one-token prefill chunk: the mask cannot tell them apart, :func:`decoding_rows`
    can), from :func:`packed_rows`."""
    prev_first = torch.cat([first.new_full((1,), -1), first[:-1]])
    prev_real = torch.cat([real.new_zeros(1), real[:-1]])
    return real & last & ~(prev_real & (prev_first == first))


def sampled_rows(logits_to_keep: torch.Tensor, q_rows: int) -> torch.Tensor:
    """bool ``[Q]``: the rows whose next token the engine samples, from Hugging Face's
    ``logits_to_keep`` (int64 ``[max_requests_per_batch]``: one ascending row index per request
    that has no prefill left, then zeros as padding: an entry counts when it is the first
    or above the one before it). The padding cannot be told from a genuine row 0, so a step
    in which no request samples marks row 0 as sampled; that misleads
    :func:`decoding_rows` only if row 0 is a one-token chunk whose prompt continues, which
    Hugging Face's scheduler (transformers 5.24) makes only at ``max_batch_tokens=1``: the
    step's first request gets the whole token budget, so otherwise its chunk is one token
    only when one prompt token is left, and then it samples. ``max_batch_tokens=1`` is
    refused (``specontext_compile.continuous_batching_config``; found by a newcomer's
    attack: every prompt token was attended sparsely)."""
    keep = logits_to_keep.long()
    genuine = torch.cat([keep.new_ones(1, dtype=torch.bool), keep[1:] > keep[:-1]]).cumprod(0).bool()
    hits = torch.zeros(q_rows, dtype=torch.long, device=keep.device)
    return hits.index_add_(0, keep.clamp(0, q_rows - 1), genuine.long()) > 0


def mask_rows(attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`packed_rows` of Hugging Face's mask ``[1, 1, Q, KV]``: ``(real, last, first, own)``.
    The host step computes it once and hands it to :func:`decoding_rows`,
    :func:`classify_step` and :func:`record_generated` (their ``rows``)."""
    return packed_rows(packed_visible(attn_mask))


def record_generated(generated: torch.Tensor, attn_mask: torch.Tensor, write_index: torch.Tensor,
                     logits_to_keep: torch.Tensor, stride: int, rows: tuple | None = None) -> None:
    """After a step: for each request's last row, in the block of its token, its physical
    row when the engine samples its next token (it decodes next), else -1 (its prefill
    continues), so :func:`decoding_rows` can tell the next step's one-row requests apart.
    ``generated``: :attr:`PagedState.generated`; ``write_index`` int64 ``[Q]``; ``rows``:
    :func:`mask_rows` of ``attn_mask`` when already computed."""
    last = (rows or mask_rows(attn_mask))[1]
    written = write_index.long()
    block = torch.where(last, written // stride, generated.shape[0] - 1)  # other rows: the scratch entry
    value = torch.where(last & sampled_rows(logits_to_keep, last.shape[0]), written, -1)
    generated.index_copy_(0, block, value)
    generated[-1] = -1


def decoding_rows(attn_mask: torch.Tensor, read_index: torch.Tensor, generated: torch.Tensor | None,
                  stride: int, rows: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(decode, chunk)`` bool ``[Q]``: the one-row requests (:func:`decode_rows`) split into
    those that decode (their previous token's row sampled this token:
    :func:`record_generated`) and one-token prefill chunks (their prompt continues or just
    ended here), which attend densely as prefill does. ``generated`` None (the engine gave no
    ``logits_to_keep``): every one-row request counts as decoding. ``rows``: :func:`mask_rows`
    of ``attn_mask`` when already computed."""
    real, last, first, own = rows or mask_rows(attn_mask)
    single = decode_rows(real, last, first)
    if generated is None:
        return single, torch.zeros_like(single)
    prev = (own - 1).clamp(min=0)
    prev_row = read_index.long()[prev]
    block = (prev_row // stride).clamp(max=generated.shape[0] - 2)
    decode = single & (own > first) & (generated[block] == prev_row)
    return decode, single & ~decode


def classify_step(attn_mask: torch.Tensor, decode: torch.Tensor | None = None,
                  rows: tuple | None = None) -> tuple[int, int]:
    """``(kind, decode rows)``: :data:`SPARSE` when every request of the step decodes,
    :data:`MIXED` when some do, else :data:`DENSE`, and how many rows decode (read on the
    host, once per step, by the backend's step function: it picks the graph variant).
    ``decode``: bool ``[Q]`` from :func:`decoding_rows`; None = every one-row request.
    ``rows``: :func:`mask_rows` of ``attn_mask`` when already computed."""
    real, last, first, _ = rows or mask_rows(attn_mask)
    if decode is None:
        decode = decode_rows(real, last, first)
    count = int(decode.sum())
    if bool((decode | ~real).all()):
        return SPARSE, count
    return (MIXED if count else DENSE), count


def step_kind(attn_mask: torch.Tensor) -> int:
    """The kind of :func:`classify_step`."""
    return classify_step(attn_mask)[0]


def decode_subset(attn_mask: torch.Tensor, rows: int, chunk: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixed step's decode rows as a step of their own (static shapes): the selection and
    sparse attention of a mixed step run over these ``rows`` rows only, not over every
    prefill row as well (a 1024-token prefill chunk otherwise ranks and gathers 1024 rows it
    never uses: 22 s against Hugging Face's 4 s per mixed step, 4 x 2K prompts on SmolLM2).

    Args:
        attn_mask: Hugging Face's mask ``[1, 1, Q, KV]``.
        rows: the most decode rows a step may have (``max_requests_per_batch``, or ``Q``);
            the backend's step function checks it on the host.
        chunk: bool ``[Q]``, one-row requests that still prefill (:func:`decoding_rows`):
            not decode rows; None = none.

    Returns:
        ``(index, mask, slot, decode)``: int64 ``[rows]``, the decode rows in order (unused
        entries 0); their mask ``[1, 1, rows, KV]`` (unused entries hide every column, so
        they count as padding rows); int64 ``[Q]``, each decode row's entry in ``index``
        (:func:`expand_decode_rows`); bool ``[Q]``, the decode rows (:func:`decode_rows`).
    """
    real, last, first, _ = packed_rows(packed_visible(attn_mask))
    decode = decode_rows(real, last, first)
    if chunk is not None:
        decode = decode & ~chunk
    index = torch.nonzero_static(decode, size=rows, fill_value=-1).view(rows)
    used = (index >= 0).view(1, 1, rows, 1)
    index = index.clamp(min=0)
    sub = attn_mask.index_select(2, index)
    hidden = False if sub.dtype == torch.bool else torch.finfo(sub.dtype).min
    slot = (decode.long().cumsum(0) - 1).clamp(0, rows - 1)
    return index, torch.where(used, sub, hidden), slot, decode


def expand_decode_rows(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[1, heads, rows, dim]`` computed for :func:`decode_subset`'s rows, back at every query
    row ``[1, heads, Q, dim]`` (a row that does not decode gets some decode row's values:
    :func:`mixed_attention` discards them)."""
    return out.index_select(2, slot)


def is_decode_step(attn_mask: torch.Tensor) -> bool:
    """Whether every request of the step has one query token (:func:`step_kind`)."""
    return step_kind(attn_mask) == SPARSE


def mixed_attention(sparse: torch.Tensor, dense: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """A mixed step's attention output ``[1, num_heads, Q, head_dim_v]``: the sparse one on
    ``decode`` rows (bool ``[Q]``), Hugging Face's dense one elsewhere."""
    return torch.where(decode.view(1, 1, -1, 1), sparse, dense)


def packed_sparse_attention(query: torch.Tensor, key_view: torch.Tensor, value_view: torch.Tensor,
                            read_index: torch.Tensor, columns: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row attends to its selected columns only, read from the paged cache.

    Args:
        query: ``[1, num_heads, Q, head_dim]``.
        key_view, value_view: the layer's views ``[rows, num_kv_heads, head_dim]`` (this step's
            write included).
        read_index: int64 ``[KV]``.
        columns: int64 ``[Q, num_kv_heads, slots]`` (:func:`packed_select`; ``-1`` = none).
        scale: softmax scale.

    Returns:
        ``[1, num_heads, Q, head_dim_v]`` in ``query.dtype`` (a row that selected nothing: 0).
    """
    logits, rows, heads = _column_logits(query, key_view, read_index, columns, scale)
    return _attend_rows(query, logits, _gather_rows(value_view, rows, heads))


def packed_refine_attention(query: torch.Tensor, key_view: torch.Tensor, value_view: torch.Tensor,
                            read_index: torch.Tensor, columns: torch.Tensor, scale: float, spec: StepSpec
                            ) -> torch.Tensor:
    """The two-stage selection's second stage (option ``candidates`` > 1), then attention:
    each row keeps ``spec.budget`` of its candidate ``columns`` by this layer's own scores
    and attends to those, reusing the logits it ranked them by (as
    :func:`~.aten_step.refine_and_attend` does for one request). The ranking is
    :func:`~.aten_step.ranked`'s for a one-token step: softmax of the layer's logits over the
    candidates, max over the query heads of each KV group; the row's first
    ``min(sink_tokens, budget - recent)`` candidates (attention sinks) and its last
    ``recent = min(max(recent_window, 1), budget)`` columns (its own token included) always
    kept. The candidates need not be sorted as a whole: their first valid entries must be the
    row's sinks (the selection's ascending output, or that output followed by the rescued
    pages' columns: :func:`~.paged_bounds.packed_rescue`).

    Args: as :func:`packed_sparse_attention`, ``columns`` holding ``spec.candidate_slots``
    candidates per row (:func:`packed_select`); ``spec``: ``budget``, ``sink_tokens``,
    ``recent_window``.

    Returns:
        ``[1, num_heads, Q, head_dim_v]`` in ``query.dtype`` (a row without candidates: 0).
    """
    logits, rows, heads = _column_logits(query, key_view, read_index, columns, scale)
    q_rows, num_kv, groups, slots = logits.shape
    valid = columns >= 0
    budget = torch.sym_min(spec.budget, slots)
    recent = torch.sym_min(max(spec.recent_window, 1), budget)
    sinks = torch.sym_min(spec.sink_tokens, budget - recent)
    own = columns.amax(-1, keepdim=True)  # the row's own token: always a candidate, the last it may see
    forced = valid & ((valid.cumsum(-1) <= sinks) | (columns > own - recent))
    score = torch.softmax(logits, dim=-1).nan_to_num(0.0).amax(2)  # [Q, Hkv, S]
    rank = torch.where(forced, float("inf"), torch.where(valid, score, _NEG))
    values, top = rank.topk(budget, dim=-1, sorted=False)  # [Q, Hkv, budget]
    kept = logits.gather(-1, top.unsqueeze(2).expand(q_rows, num_kv, groups, budget))
    kept = kept.masked_fill((values == _NEG).unsqueeze(2), _NEG)
    return _attend_rows(query, kept, _gather_rows(value_view, rows.gather(-1, top), heads))


def _column_logits(query: torch.Tensor, key_view: torch.Tensor, read_index: torch.Tensor, columns: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' float32 logits over their columns ``[Q, Hkv, g, S]`` (``-inf`` at ``-1``
    padding), the columns' physical rows ``[Q, Hkv, S]`` and the KV-head index ``[1, Hkv, 1]``."""
    q_rows, d = query.shape[2], query.shape[-1]
    num_kv = key_view.shape[1]
    rows = read_index[columns.clamp(min=0)]  # [Q, Hkv, S] physical rows
    heads = torch.arange(num_kv, device=rows.device).view(1, num_kv, 1)
    q = query[0].transpose(0, 1).reshape(q_rows, num_kv, -1, d)  # [Q, Hkv, g, D]
    logits = query_key_logits(q, _gather_rows(key_view, rows, heads), scale)
    return logits.masked_fill(~(columns >= 0).unsqueeze(2), _NEG), rows, heads


def _gather_rows(view: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """``view[rows, heads]`` (``view`` ``[rows, num_kv_heads, dim]``; ``rows`` ``[Q, Hkv, S]``,
    ``heads`` ``[1, Hkv, 1]``) as one ``index_select`` over the view's ``(row, head)`` pairs,
    which eager CPU runs faster than the two-index gather (docs/serving.md)."""
    num_kv, dim = view.shape[1], view.shape[2]
    flat = (rows * num_kv + heads).reshape(-1)
    return view.reshape(-1, dim).index_select(0, flat).view(*rows.shape, dim)


def _attend_rows(query: torch.Tensor, logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax of ``logits`` ``[Q, Hkv, g, S]`` times ``values`` ``[Q, Hkv, S, Dv]``, as
    ``[1, num_heads, Q, Dv]`` in ``query.dtype``."""
    _, num_heads, q_rows, _ = query.shape
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).to(values.dtype)
    out = torch.matmul(probs, values)  # [Q, Hkv, g, Dv]
    return out.reshape(q_rows, num_heads, -1).transpose(0, 1).unsqueeze(0).to(query.dtype)
