"""Draft retrieval heads (option ``retrieval_head``; SpeContext section 4): a small EAGLE-3
style head with its own key cache scores the context. ``specontext::draft_step`` writes
the head's keys of the step's tokens into that cache (every graph, prefill included; an
embedding-only head reads the token embedding, a fused one also the target's previous-step
hidden states at its auxiliary layers, kept by :func:`~..runtime.aten_step.record_hidden`), and
:func:`~..runtime.scorers.head_select` with the ``"draft"`` scorer selects with the step's draft
query (both direct calls)."""

from __future__ import annotations

import logging

import torch
from torch import fx

from ..runtime import aten_step
from ..runtime.protocol import DraftAnchor, RetrievalAnchor
from .heads import ScoreInputs, SelectionHead
from .sites import KV_WRITE, AttentionSite, decoder_layer_outputs, find_token_embedding, is_op

logger = logging.getLogger(__name__)

__all__ = ["DraftHead"]

DRAFT_ANCHOR = torch.ops.specontext.draft_anchor
DRAFT_STEP = torch.ops.specontext.draft_step.default
DRAFT_RECORD = aten_step.record_hidden


class DraftHead(SelectionHead):
    """The draft head in ``folder`` (resolved); ``label`` ``"draft:<folder>"``."""

    scorer = "draft"

    def __init__(self, folder: str):
        self.folder = folder
        self.label = f"draft:{folder}"
        self.inserted: tuple | str | None = None

    def prepare(self, graph: fx.Graph, anchor: fx.Node, anchored: RetrievalAnchor,
                resolved: list[AttentionSite]) -> str | None:
        self.inserted = self._insert_step(graph, resolved[0].q_len)
        if isinstance(self.inserted, str):
            logger.info("specontext: the draft head does not run in this graph: %s", self.inserted)
            return self.inserted
        return None

    def unusable(self, decode: list[AttentionSite]) -> str | None:
        step, write, reason = self.inserted
        if reason is not None:
            return reason
        if any(n.op != "placeholder" for n in (step.args[0], step.args[1], write.args[0], write.args[2])):
            return "the KV store is allocated inside this graph (first call on a fresh cache)"
        num_kv = write.args[0].meta.get("example_value", write.args[0].meta.get("val")).shape[1]
        if len({s.q_len for s in decode}) != 1 or any(s.num_kv_heads != num_kv for s in decode):
            return "decode sites differ in query length or KV heads from layer 0 (one shared selection)"
        return None

    def after_break(self) -> str | None:
        return "after a graph break the draft head's selection does not reach this graph yet"

    def score_inputs(self, graph: fx.Graph, anchor: fx.Node, mask: fx.Node | None,
                     decode: list[AttentionSite]) -> ScoreInputs:
        """The draft step's query and the head's key cache, after the draft step and the mask;
        layer 0's store for the target's shape. The head scores with its own scale
        (``head_dim ** -0.5``): the site's stands in the variant."""
        step, write, _ = self.inserted
        order = {n: i for i, n in enumerate(graph.nodes)}
        after = max((step, mask or step), key=order.__getitem__)
        return ScoreInputs(after, (step, step.args[0], step.args[1]), [write.args[0]], write.args[2],
                           decode[0].q_len, decode[0].scale)

    def _insert_step(self, graph: fx.Graph, q_len: int | None):
        """Insert ``draft_step`` (and, for a fused head, ``draft_record``); returns ``(step,
        layer-0 kv_write, reason decode sites stay dense or None)``, or the reason nothing
        could be inserted.

        Embedding-only head, or a fused head on a one-token step: ``draft_step`` goes after
        the draft anchor and its inputs, before layer 0's ``kv_write`` (it reads the count
        before the step); a fused head reads the recorded previous-step hidden states, and
        ``draft_record`` keeps this step's after the last auxiliary layer. A fused head on a
        longer step (prefill) needs this step's hidden states: ``draft_step`` then runs after
        the last auxiliary layer (``after_write``), followed by ``draft_record``; such a step
        cannot select before layer 0, so its sites stay dense.
        """
        from ..runtime.draft_retrieval import head_spec

        anchors = [n for n in graph.nodes if is_op(n, DRAFT_ANCHOR)]
        if len(anchors) != 1:
            return (f"retrieval_head is set but the graph has {len(anchors)} draft-head key caches "
                    "(expected one): build the cache with SpeContextCache(config, max_cache_len=..., "
                    "retrieval_head=DIR) (specontext_compile.compile and make_cache do it)")
        anchor = anchors[0]
        anchored = DraftAnchor.of(anchor)
        draft_keys, draft_length, aux_state, aux_valid, head = (
            anchored.draft_keys, anchored.draft_length, anchored.aux_state, anchored.aux_valid, anchored.head)
        if head != self.folder:
            return (f"the cache's draft head is {head} but the backend's retrieval_head is "
                    f"{self.folder}: build the cache with the same folder")
        order = {n: i for i, n in enumerate(graph.nodes)}
        writes = [n for n in graph.nodes if is_op(n, KV_WRITE) and order[n] > order[anchor]]
        if not writes:
            return "no KV write follows the draft anchor"
        write = writes[0]
        spec = head_spec(self.folder)
        ids, weight, reason = find_token_embedding(graph, write, spec.vocab_size)
        if reason is not None:
            return reason
        weight_val = weight.meta.get("example_value", weight.meta.get("val"))
        if not spec.has_embedding and weight_val.shape[1] != spec.hidden:
            return (f"the head has no embedding of its own and the target's is {weight_val.shape[1]} "
                    f"wide, not the head's hidden size {spec.hidden}")
        length = write.args[2]
        base = (draft_keys, draft_length, length, ids, weight, head)
        if spec.variant == "embedding" or q_len == 1:
            # after the anchor and every input (a fresh cache moves layer 0's length in-graph),
            # before layer 0's kv_write (so ``length`` is still the count before this step)
            last = max((anchor, ids, weight, length), key=lambda n: order[n])
            if order[last] > order[write]:
                return f"{last.name} (an input of the draft head) is computed after layer 0's KV write"
        if spec.variant == "embedding":
            with graph.inserting_after(last):
                step = graph.call_function(DRAFT_STEP, (*base, [], False))
            return step, write, None
        try:  # the EAGLE-3 default needs the layer count: one KV write per decoder layer
            aux_layers = spec.aux_layers_for(len(writes))
        except ValueError as err:
            return f"fused draft head: {err}"
        outputs, reason = decoder_layer_outputs(graph, aux_layers)
        if reason is not None:
            return f"fused draft head: {reason}"
        widths = [o.meta.get("example_value", o.meta.get("val")).shape[-1] for o in outputs]
        if sum(widths) != spec.aux_width:
            return (f"fused draft head: its auxiliary input is {spec.aux_width} wide, the outputs of "
                    f"layers {list(aux_layers)} are {widths}")
        last_out = max(outputs, key=lambda n: order[n])
        if q_len == 1:
            with graph.inserting_after(last):
                step = graph.call_function(DRAFT_STEP, (*base, [aux_state, aux_valid], False))
            with graph.inserting_after(last_out):
                graph.call_function(DRAFT_RECORD, (aux_state, aux_valid, list(outputs), length))
            return step, write, None
        with graph.inserting_after(last_out):
            step = graph.call_function(DRAFT_STEP, (*base, [aux_state, aux_valid, *outputs], True))
        with graph.inserting_after(step):
            graph.call_function(DRAFT_RECORD, (aux_state, aux_valid, list(outputs), length))
        return step, write, (f"fused draft head: a step of {q_len} tokens needs its own hidden "
                             "states, known only after the auxiliary layers (too late to select)")
