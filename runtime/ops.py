"""The runtime's custom operators (namespace ``specontext``), registered with torch.library.

Every op has a fake (meta) implementation so that dynamo and AOT tracing see it as one
opaque node, and declares the tensors it mutates so no compiler drops or reorders it.
The ops are registered when this module is imported (importing ``specontext_compile`` does),
which changes no other global state. They live by role, each beside the aten body it calls
(:mod:`.aten_step`): ``ops_store`` (KV store, anchor, counters), ``ops_selection``,
``ops_attention``, ``ops_draft``; this module gathers them.

=====================  ====================================================================
op                     role
=====================  ====================================================================
kv_write               append this step's keys/values into a layer's preallocated KV store
page_bounds_write      after a write: recompute the per-page key bounds of the touched pages
page_shift_from_mask   at a prompt's first write: align each row's pages to its first real token
retrieval_anchor       marks, in the traced graph, where the retrieval state enters (layer 0)
count_step             advances the cache's path counters once per decode step
check_capacity         (compiled CPU steps) raises before a write would pass the store's end
record_query           keeps layer ``j``'s last query row for the next step's selection
speculative_select     the selection node: runs once per step, before the first layer
refine_selection       per layer: its own query keeps ``budget`` of the step's candidates
sparse_attention       attention of one layer over the selected tokens only
mla_latent_query       an MLA layer's absorbed query (scores the latent cache directly)
mla_sparse_attention   MLA attention over the selected latent rows, then the value up-projection
draft_anchor           marks where the draft head's key cache enters (layer 0, ``retrieval_head``)
draft_step             the draft head's Q/K of the step's tokens; K into its own key cache
draft_record           keeps the last token's auxiliary hidden states (fused draft heads)
draft_select           the selection node when the draft head scores (``retrieval_head``)
=====================  ====================================================================
"""

from __future__ import annotations

from .ops_attention import _mask_allows_selection, _use_triton, sparse_attention  # noqa: F401
from .ops_mla import mla_latent_query, mla_sparse_attention
from .ops_draft import draft_anchor, draft_record, draft_select, draft_step
from .ops_selection import record_query, refine_selection, speculative_select
from .ops_store import (CacheCapacityError, check_capacity, count_step, kv_write, page_bounds_write,
                        page_shift_from_mask, retrieval_anchor)
from .sparse_attention import sparse_attention_reference  # noqa: F401  (the torch path's reference)

__all__ = ["CacheCapacityError", "check_capacity", "count_step", "draft_anchor", "draft_record", "draft_select",
           "draft_step", "kv_write", "mla_latent_query",
           "mla_sparse_attention", "page_bounds_write", "page_shift_from_mask", "record_query", "refine_selection",
           "retrieval_anchor", "sparse_attention", "speculative_select"]
