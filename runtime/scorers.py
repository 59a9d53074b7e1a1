"""Selection heads as scorers: what each head scores, and the one selection node every head uses.

A selection head (SpeContext section 4) is, at run time, two plain-torch functions over what
it recorded in earlier steps (issue 53, item 4):

* ``score(record, stores, cached, q_len, visible, variant, position_bias)`` -> float32
  ``[batch, num_kv_heads, capacity]``, higher = keep; 0 at positions the step may not see (a
  head with a CPU kernel of its own also takes ``kernel=True`` where the pass chose it,
  ``StepSpec.cpu_kernel``: :meth:`~specontext_compile.passes.heads.SelectionHead.cpu_kernel`);
* ``ready(record, stores, cached, q_len)`` -> bool scalar tensor: the record covers the
  context (a record from before a crop, a reset, or a step run without the backend does not).

:func:`head_select` is the only selection node the pass inserts (one per step and sliding
window, for whichever head): it looks the head up in :data:`SCORERS` by name, ranks by the
head's scores where the head is ready and by recency elsewhere (a ``where`` on the device, no
host read), and keeps ``spec.candidate_slots`` positions with
:func:`~.aten_step.select_positions` (sinks, recent window, top-k). :func:`head_ready` is the
node that counts the steps ranked by recency. The benchmark harness's policies call the same
scorers (``benchmarks/policies.py``), so what it measures is what the step runs.

Heads (``record``, ``stores``):

* ``"lagged-query"`` (the default, training-free): ``record = (query_state, query_valid)``
  written by :func:`~.aten_step.record_query` (``[slots, batch, num_heads, 1, head_dim]`` and
  int64 ``[slots]``, the length each slot was recorded at), plus, with the option
  ``selection_keys="int8"``, the retrieval layers' int8 key rows, one ``(key_levels,
  key_scales)`` per store (:mod:`.key_mirror`), that the CPU kernel scores instead of the
  stores; ``stores``: the retrieval layers' key stores ``[batch, num_kv_heads, capacity,
  head_dim]`` (an MLA layer's as its ``(latent, rope)`` pair).
* ``"draft"`` (a distilled / EAGLE-3 head with its own key cache, option ``retrieval_head``):
  ``record = (query, draft_keys, draft_length)`` from ``specontext::draft_step``
  (``[batch, head_heads, 1, head_dim]``, ``[batch, head_kv_heads, >= capacity, head_dim]``,
  int64 scalar: positions the head's cache holds); ``stores = [key_cache]``, layer 0's store
  (only its shape is read: batch, KV heads, capacity).

Adding a head: its two functions and one :data:`SCORERS` entry here, and one
:class:`~specontext_compile.passes.heads.SelectionHead` that inserts what it records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import cpu_selection
from .aten_step import select_positions
from .draft_retrieval import map_to_target_heads
from .sparse_attention import masked_group_max_softmax, row_visibility
from .spec import AttentionVariant, StepSpec

__all__ = ["SCORERS", "Scorer", "draft_score", "draft_select", "head_ready", "head_select", "lagged_query_score",
           "lagged_query_scores", "speculative_select", "store_shape"]


@dataclasses.dataclass(frozen=True)
class Scorer:
    """One selection head's run-time functions (module docstring)."""

    score: Callable[..., torch.Tensor]
    ready: Callable[..., torch.Tensor]


def store_shape(store) -> tuple[int, int, int]:
    """``(batch, num_kv_heads, capacity)`` of a key store ``[batch, num_kv_heads, capacity,
    head_dim]`` or of an MLA ``(latent, rope)`` pair (its latent store)."""
    keys = store[0] if isinstance(store, (tuple, list)) else store
    return keys.shape[0], keys.shape[1], keys.shape[-2]


def lagged_query_ready(record: tuple, stores: list, cached: torch.Tensor, q_len: int) -> torch.Tensor:
    """bool scalar: each retrieval layer's slot of ``query_valid`` was recorded at exactly
    ``cached`` tokens (by the step that wrote the last cached token)."""
    query_valid = record[1]
    return (query_valid[: len(stores)] == cached).all()


def lagged_query_score(record: tuple, stores: list, cached: torch.Tensor, q_len: int,
                       visible: torch.Tensor | None, variant: AttentionVariant,
                       position_bias: torch.Tensor | None = None, kernel: bool = False) -> torch.Tensor:
    """The lagged-query head's scores: per retrieval layer ``i``, ``softmax(q_i . K_i *
    scale)`` of its recorded query over the written positions ``< cached`` (and ``visible``
    ones: left padding is left out), the max over the query heads of each KV group (paper
    section 4, GQA), summed over the layers. ``position_bias``: ALiBi's bias, the same for
    every retrieval layer. Returns float32 ``[batch, num_kv_heads, capacity]``, 0 where not
    scored. ``kernel`` (the pass's choice, :func:`~.routes.selection_kernel`): our C++ kernel
    computes it (:func:`~.cpu_selection.lagged_scores`: reads only the written keys), from the
    retrieval layers' int8 rows when ``record`` carries them (:mod:`.key_mirror`; the torch body
    reads the stores)."""
    query_state = record[0]
    if kernel:  # with the int8 rows where the pass gave them (option selection_keys)
        return cpu_selection.lagged_scores(query_state, stores, cached, visible, variant,
                                           record[2] if len(record) > 2 else None)
    _, _, capacity = store_shape(stores[0])
    written = torch.arange(capacity, device=query_state.device) < cached
    if visible is not None:
        written = written & visible
    total = None
    for i, store in enumerate(stores):
        keys, rope = store if isinstance(store, (tuple, list)) else (store, None)
        probs = masked_group_max_softmax(query_state[i], keys, written, variant.scale, rope, position_bias,
                                         variant.fused_products)
        total = probs if total is None else total + probs
    return total


def draft_ready(record: tuple, stores: list, cached: torch.Tensor, q_len: int) -> torch.Tensor:
    """bool scalar: the draft head's key cache holds every position this step scores
    (``draft_length >= cached + q_len``)."""
    return record[2] >= cached + q_len


def draft_score(record: tuple, stores: list, cached: torch.Tensor, q_len: int,
                visible: torch.Tensor | None, variant: AttentionVariant,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The draft head's scores: the softmax of its query over its own keys of positions
    ``< cached + q_len`` (causal: the step's last token sees itself; ``visible`` ones only),
    scale ``head_dim ** -0.5``, group max per head KV head, mapped to the target's KV heads
    (:func:`~.draft_retrieval.map_to_target_heads`). Returns float32 ``[batch,
    num_kv_heads, capacity]``. ``position_bias`` is not used (the head has no ALiBi)."""
    query, draft_keys, _ = record
    _, num_kv, capacity = store_shape(stores[0])
    allowed = torch.arange(capacity, device=query.device) < cached + q_len
    if visible is not None:
        allowed = allowed & visible
    scores = masked_group_max_softmax(query, draft_keys[:, :, :capacity], allowed, query.shape[-1] ** -0.5,
                                      fused=variant.fused_products)
    return map_to_target_heads(scores, num_kv)


#: every selection head's scorer, by the name the pass gives :func:`head_select`
SCORERS: dict[str, Scorer] = {
    "lagged-query": Scorer(lagged_query_score, lagged_query_ready),
    "draft": Scorer(draft_score, draft_ready),
}


def _scorer(head: str) -> Scorer:
    try:
        return SCORERS[head]
    except KeyError:
        raise ValueError(f"no selection head named {head!r}; known: {sorted(SCORERS)}") from None


def head_ready(head: str, record: tuple, stores: list, length: torch.Tensor, q_len: int) -> torch.Tensor:
    """bool scalar tensor: head ``head`` can score this step (``length``: tokens written
    before it); False means :func:`head_select` ranked by recency."""
    return _scorer(head).ready(record, stores, length, q_len)


def head_select(head: str, record: tuple, stores: list, length: torch.Tensor, q_len: int, spec: StepSpec,
                variant: AttentionVariant, attn_mask: torch.Tensor | None = None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The step's selection node, the same for every head (the pass inserts it once per step
    and sliding window, before layer 0).

    Args:
        head: a key of :data:`SCORERS`.
        record, stores: the head's inputs (module docstring).
        length: int64 scalar tensor, tokens written before this step.
        q_len: tokens in this step (always selected; the pass keeps longer steps dense).
        spec: ``candidate_slots``, ``sink_tokens``, ``recent_window``, and ``cpu_kernel``
            (the pass's choice of the head's CPU kernel, :func:`~.routes.selection_kernel`).
        variant: the retrieval layers' scale, sliding window and products' form.
        attn_mask: a site's Hugging Face mask (padding-aware selection:
            :func:`~.sparse_attention.row_visibility`), or None.
        position_bias: ALiBi's per-head bias ``[batch|1, num_heads, 1, capacity]``, or None.

    Returns:
        int64 ``[batch, num_kv_heads, max(q_len, min(spec.candidate_slots, capacity))]``,
        ascending, ``-1`` padding first (:func:`~.aten_step.select_positions`); ranked by
        recency (the position) when the head is not ready.

    Raises:
        ValueError: for a head not in :data:`SCORERS`.
    """
    scorer = _scorer(head)
    b, num_kv, capacity = store_shape(stores[0])
    visible = row_visibility(attn_mask, capacity)
    kernel = {"kernel": True} if spec.cpu_kernel else {}  # only a head with a CPU kernel is ever given one
    scores = scorer.score(record, stores, length, q_len, visible, variant, position_bias, **kernel)
    recency = torch.arange(capacity, device=scores.device).to(torch.float32).expand(b, num_kv, capacity)
    scores = torch.where(scorer.ready(record, stores, length, q_len), scores, recency)
    slots = torch.sym_max(q_len, torch.sym_min(spec.candidate_slots, capacity))
    return select_positions(scores, length, q_len, slots, spec.sink_tokens, spec.recent_window,
                            variant.sliding_window, visible)


def lagged_query_scores(query_state: torch.Tensor, query_valid: torch.Tensor, key_caches: list,
                        cached: torch.Tensor, scale: float, visible: torch.Tensor | None = None,
                        position_bias: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """The lagged-query head's scores with its recency fallback, as :func:`head_select` ranks
    them: :func:`lagged_query_score` where the head is ready, the position itself elsewhere.
    float32 ``[batch, num_kv_heads, capacity]`` (shapes: module docstring)."""
    record, variant = (query_state, query_valid), AttentionVariant(scale, fused_products=fused)
    scores = lagged_query_score(record, key_caches, cached, 1, visible, variant, position_bias)
    b, num_kv, capacity = store_shape(key_caches[0])
    recency = torch.arange(capacity, device=scores.device).to(torch.float32).expand(b, num_kv, capacity)
    return torch.where(lagged_query_ready(record, key_caches, cached, 1), scores, recency)


def speculative_select(lagged: tuple[torch.Tensor, torch.Tensor], key_caches: list, length: torch.Tensor,
                       q_len: int, spec: StepSpec, variant: AttentionVariant,
                       attn_mask: torch.Tensor | None = None, position_bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """:func:`head_select` with the lagged-query head (``lagged = (query_state,
    query_valid)``, ``key_caches``: the retrieval layers' key stores)."""
    return head_select("lagged-query", lagged, key_caches, length, q_len, spec, variant, attn_mask, position_bias)


def draft_select(query: torch.Tensor, draft_cache: tuple[torch.Tensor, torch.Tensor], key_cache: torch.Tensor,
                 length: torch.Tensor, q_len: int, spec: StepSpec, variant: AttentionVariant,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`head_select` with a draft head (``draft_cache = (draft_keys, draft_length)``,
    ``key_cache``: layer 0's store, for its shape)."""
    return head_select("draft", (query, *draft_cache), [key_cache], length, q_len, spec, variant, attn_mask)
