"""The runtime's custom operators (namespace ``specontext``), registered with torch.library.

Every op has a fake (meta) implementation so that dynamo and AOT tracing see it as one
opaque node, and declares the tensors it mutates so no compiler drops or reorders it.
The ops are registered when this module is imported (importing ``specontext_compile`` does),
which changes no other global state. They live by role, each beside the aten body it calls
(:mod:`.aten_step`): ``ops_store`` (KV store, anchor, counters), ``ops_attention``,
``ops_draft``; :mod:`.offload_ops` registers the KV offload's; this module
gathers the others.

=====================  ====================================================================
op                     role
=====================  ====================================================================
kv_write               append this step's keys/values into a layer's preallocated KV store, and
                       recompute the per-page key bounds of the pages it touched
retrieval_anchor       marks, in the traced graph, where the retrieval state enters (layer 0)
check_capacity         (compiled CPU steps) raises before a write would pass the store's end
sparse_attention       attention of one layer over the selected tokens only (an MLA site:
                       over the selected latent rows, before the value up-projection)
draft_anchor           marks where the draft head's key cache enters (layer 0, ``retrieval_head``)
draft_step             the draft head's Q/K of the step's tokens; K into its own key cache
=====================  ====================================================================

What the pass inserts that needs no op of its own is a direct call of its function (no
dispatcher, no fake, the same code eager and compiled): the selection nodes
(``scorers.head_select``, once per step before the first layer, for every head), the per-layer refinement
(``aten_step.refine_selection``: the layer's own query keeps ``budget`` of the step's
candidates), ``aten_step.record_query`` (a
retrieval layer's query for the next step), ``aten_step.record_hidden`` (a fused draft
head's auxiliary hidden states), ``aten_step.count_step`` (the path counters),
``aten_step.store_selection`` / ``load_selection`` (a selection across a graph break),
``page_bounds.shift_from_mask`` (pages aligned to a padded row's first token) and
``mla.latent_query`` (an MLA layer's absorbed query). Those that change state in place are
registered with :func:`torch.fx.node.has_side_effect`, so dead-code elimination keeps them.
"""

from __future__ import annotations

from .ops_attention import sparse_attention
from .ops_draft import draft_anchor, draft_step
from .ops_store import CacheCapacityError, check_capacity, kv_write, retrieval_anchor
from .sparse_attention import sparse_attention_reference  # noqa: F401  (the torch path's reference)

__all__ = ["CacheCapacityError", "check_capacity", "draft_anchor", "draft_step", "kv_write", "retrieval_anchor",
           "sparse_attention"]
