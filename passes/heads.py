"""The selection-head protocol: what a head records each step and how it selects.

A *selection head* predicts, once per decode step and before layer 0, which cached tokens
the step's layers will attend to (SpeContext section 4). The rewrite pass
(:mod:`.sparse_rewrite`) drives every head through this one interface and has no branch on
which head it holds:

1. :meth:`SelectionHead.prepare`, in every graph whose first retrieval anchor is layer 0
   (prefill included): insert what the head records for the next step, or say why it
   cannot select in this graph;
2. :meth:`SelectionHead.serves`: the decode sites one selection of this head can serve
   (the others get their reason);
3. :meth:`SelectionHead.unusable`: why the head cannot select for these sites, or None;
4. :meth:`SelectionHead.select`, once per distinct sliding window: insert the selection
   node, whose output is int64 ``[batch, num_kv_heads, min(spec.candidate_slots,
   capacity)]`` positions (``-1`` padding);
5. :meth:`SelectionHead.ready`, once per step (optional): insert the bool scalar saying
   whether the head's state covers the context (else its selections rank by recency), which
   the pass counts (``path_counts()["recency_fallback_steps"]``).

Heads: :class:`~.head_lagged.LaggedQueryHead` (training-free, the default) and
:class:`~.head_draft.DraftHead` (option ``retrieval_head``: embedding-only and fused heads).
Adding a head is one module with a subclass, one line in
:func:`~.sparse_rewrite.make_head`, and its test.
"""

from __future__ import annotations

import abc

from torch import fx

from ..runtime.protocol import RetrievalAnchor
from ..runtime.spec import StepSpec
from .sites import AttentionSite

__all__ = ["SelectionHead"]


class SelectionHead(abc.ABC):
    """One selection head, fresh for each graph the pass rewrites (it keeps the nodes it
    inserted between the calls below)."""

    label: str  # RewriteResult.selection_head: "lagged-query" or "draft:<folder>"

    @property
    def retrieval_layers(self) -> tuple[int, ...]:
        """The layers whose queries drive the selection (RewriteResult.retrieval_layers)."""
        return ()

    @abc.abstractmethod
    def prepare(self, graph: fx.Graph, anchor: fx.Node, anchored: RetrievalAnchor,
                resolved: list[AttentionSite]) -> str | None:
        """Insert what the head records each step (``resolved``: the graph's sites with a KV
        store, in layer order); returns why it cannot select in this graph, or None."""

    def serves(self, decode: list[AttentionSite]) -> list[AttentionSite]:
        """The decode sites one selection of this head can serve; give the others a reason."""
        return decode

    @abc.abstractmethod
    def unusable(self, decode: list[AttentionSite]) -> str | None:
        """Why the head cannot select for ``decode`` (after :meth:`prepare` succeeded), or None."""

    def after_break(self) -> str | None:
        """Why a graph after a graph break cannot read the step's stored selection, or None."""
        return None

    @abc.abstractmethod
    def select(self, graph: fx.Graph, anchor: fx.Node, spec: StepSpec, window: int, mask: fx.Node | None,
               decode: list[AttentionSite]) -> fx.Node:
        """Insert the step's selection node for the sites of sliding window ``window`` (0 =
        full attention) with ``mask`` (a site's Hugging Face mask node, or None); returns it."""

    def ready(self, graph: fx.Graph, selection: fx.Node) -> fx.Node | None:
        """Insert, after ``selection`` (a node :meth:`select` returned), the bool scalar tensor
        that is True when the head could score this step (False: the selection ranked by
        recency) and return it; None (the default) for a head that never falls back."""
        return None
