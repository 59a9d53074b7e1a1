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
4. :meth:`SelectionHead.score_inputs`: the nodes the head scores from (its ``record`` and
   ``stores``, :mod:`~..runtime.scorers`) and the node the selection must follow.

The base class then inserts the same two nodes for every head: the selection,
:func:`~..runtime.scorers.head_select` (``scorer`` names the head's entry of
:data:`~..runtime.scorers.SCORERS`; once per distinct sliding window; int64 ``[batch,
num_kv_heads, min(spec.candidate_slots, capacity)]`` positions, ``-1`` padding), and once per
step :func:`~..runtime.scorers.head_ready`, the bool scalar saying whether the head's record
covers the context (else the selection ranked by recency), which the pass counts
(``path_counts()["recency_fallback_steps"]``). What a head computes at run time is its two
functions in :mod:`~..runtime.scorers`, plain torch; this protocol only says where its
record is written and read.

Heads: :class:`~.head_lagged.LaggedQueryHead` (training-free, the default) and
:class:`~.head_draft.DraftHead` (option ``retrieval_head``: embedding-only and fused heads).
Adding a head is its scorer (:mod:`~..runtime.scorers`), one module with a subclass here, one line in
:func:`~.sparse_rewrite.make_head`, and its entry in the heads' test (``tests/test_scorers.py``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple

from torch import fx

from ..runtime import scorers
from ..runtime.protocol import RetrievalAnchor, op_arguments
from ..runtime.spec import AttentionVariant, StepSpec
from .sites import AttentionSite

__all__ = ["ScoreInputs", "SelectionHead"]


class ScoreInputs(NamedTuple):
    """What :meth:`SelectionHead.select` hands :func:`~..runtime.scorers.head_select`."""

    after: fx.Node  # the selection goes after this node (and after the mask)
    record: tuple  # the head's record (runtime/scorers.py), nodes
    stores: list  # the head's stores (runtime/scorers.py), nodes
    length: fx.Node  # int64 scalar: tokens written before the step
    q_len: int | None  # tokens in the step
    scale: float  # the scores' softmax scale as the variant carries it (a draft head uses its own)
    position_bias: fx.Node | None = None  # ALiBi's bias node, or None


class SelectionHead(abc.ABC):
    """One selection head, fresh for each graph the pass rewrites (it keeps the nodes it
    inserted between the calls below)."""

    label: str  # RewriteResult.selection_head: "lagged-query" or "draft:<folder>"
    scorer: str  # its key in runtime.scorers.SCORERS

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
    def score_inputs(self, graph: fx.Graph, anchor: fx.Node, mask: fx.Node | None,
                     decode: list[AttentionSite]) -> ScoreInputs:
        """The nodes the head's scorer reads and where its selection goes (may insert nodes
        the selection reads, e.g. a rollback's restore)."""

    def select(self, graph: fx.Graph, anchor: fx.Node, spec: StepSpec, window: int, mask: fx.Node | None,
               decode: list[AttentionSite]) -> fx.Node:
        """Insert the step's :func:`~..runtime.scorers.head_select` node for the sites of
        sliding window ``window`` (0 = full attention) with ``mask`` (a site's Hugging Face
        mask node, or None) and return it. The function is looked up when the pass runs (a
        wrapper set before compiling is called)."""
        inputs = self.score_inputs(graph, anchor, mask, decode)
        # the variant carries the window (and, once lowered for inductor, the products' form)
        variant = AttentionVariant(inputs.scale, sliding_window=window)
        spec = dataclasses.replace(spec, cpu_kernel=self.cpu_kernel(inputs, spec))  # decided once, here
        inputs = self.with_mirror(inputs, spec.cpu_kernel)
        with graph.inserting_after(inputs.after):
            return graph.call_function(scorers.head_select, (
                self.scorer, inputs.record, inputs.stores, inputs.length, inputs.q_len, spec, variant, mask,
                inputs.position_bias))

    def cpu_kernel(self, inputs: ScoreInputs, spec: StepSpec) -> bool:
        """Whether the head's scores run its CPU kernel (the selection node's
        ``StepSpec.cpu_kernel``), decided from ``inputs``' example values; a head without a
        kernel keeps False."""
        return False

    def with_mirror(self, inputs: ScoreInputs, kernel: bool) -> ScoreInputs:
        """``inputs`` with what the head's kernel reads instead of the stores, if any (the
        lagged-query head's int8 keys, option ``selection_keys``); a head without keeps ``inputs``."""
        return inputs

    def ready(self, graph: fx.Graph, selection: fx.Node) -> fx.Node:
        """Insert, after ``selection`` (a node :meth:`select` returned), the bool scalar tensor
        that is True when the head could score this step (False: the selection ranked by
        recency), :func:`~..runtime.scorers.head_ready`, and return it."""
        args = op_arguments(selection, scorers.head_select)
        with graph.inserting_after(selection):
            return graph.call_function(scorers.head_ready, (args["head"], args["record"], args["stores"],
                                                            args["length"], args["q_len"]))
