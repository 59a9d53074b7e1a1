"""The rewrite pass: dense attention over a SpeContext KV store -> sparse attention.

For a graph whose matched sites (see :mod:`.sites`) have single-token (decode) queries:

1. insert ``specontext::speculative_select`` right after ``specontext::retrieval_anchor``
   (layer 0, before any attention): one selection per step, shared by every layer (one per
   distinct sliding window when layers differ: Gemma's alternating sliding/global layers);
2. replace each matched site by ``specontext::sparse_attention`` over that selection;
3. record each retrieval layer's query with ``specontext::record_query`` (for the next
   step's selection) — also in prefill graphs, whose attention stays dense and exact.

Sites that do not match stay dense; their reasons are returned and logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import torch
from torch import fx

from ..config import default_retrieval_layers
from .sites import AttentionSite, find_attention_sites, is_op

logger = logging.getLogger(__name__)

__all__ = ["RewriteResult", "SparseAttentionPass"]

ANCHOR = torch.ops.specontext.retrieval_anchor
SELECT = torch.ops.specontext.speculative_select.default
SPARSE = torch.ops.specontext.sparse_attention.default
RECORD = torch.ops.specontext.record_query.default


@dataclasses.dataclass
class RewriteResult:
    """What one run of the pass did to one graph."""

    sites: list[AttentionSite]
    rewritten: int = 0
    phase: str = "none"  # "decode", "prefill" or "none"
    retrieval_layers: tuple[int, ...] = ()
    selection_inserted: bool = False
    selections: list[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.sites)

    def fallbacks(self) -> list[tuple[int | None, str]]:
        """(layer, reason) of every site left dense."""
        return [(s.layer, s.reason) for s in self.sites if s.reason]


def _source_hash() -> str:
    files = sorted(Path(__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]


class SparseAttentionPass:
    """Callable FX pass with a stable identity (``uuid``) covering its code and config.

    Args:
        budget: selected tokens per KV head per step.
        sink_tokens, recent_window: always-kept first / last tokens (inside the budget).
        retrieval_layers: layers whose previous-step queries drive the selection; negative
            counts from the end; None = :func:`default_retrieval_layers`.
        max_sparse_q_len: longest step (tokens) rewritten as sparse; longer = prefill.
    """

    def __init__(self, budget: int, sink_tokens: int, recent_window: int,
                 retrieval_layers: tuple[int, ...] | None, max_sparse_q_len: int = 16,
                 kernel: str = "auto"):
        self.budget, self.sink_tokens, self.recent_window = budget, sink_tokens, recent_window
        self.retrieval_layers, self.max_sparse_q_len = retrieval_layers, max_sparse_q_len
        self.kernel = kernel

    def uuid(self) -> str:
        cfg = (self.budget, self.sink_tokens, self.recent_window, self.retrieval_layers,
               self.max_sparse_q_len, self.kernel)
        return f"specontext-sparse-{_source_hash()}-{hashlib.sha256(repr(cfg).encode()).hexdigest()[:8]}"

    def _pick_layers(self, num_layers: int) -> list[int]:
        layers = self.retrieval_layers or default_retrieval_layers(num_layers)
        picked = {min(max(j + num_layers if j < 0 else j, 0), num_layers - 1) for j in layers}
        return sorted(picked)

    def __call__(self, graph: fx.Graph) -> RewriteResult:
        sites = find_attention_sites(graph)
        result = RewriteResult(sites=sites)
        resolved = sorted((s for s in sites if s.layer is not None), key=lambda s: s.layer)
        anchors = [n for n in graph.nodes if is_op(n, ANCHOR)]
        if not resolved:
            return result
        if len(anchors) != 1:
            for s in sites:
                s.reason = s.reason or (
                    f"expected one retrieval anchor in the graph, found {len(anchors)} (a graph "
                    "break split the step: the selection is made in layer 0's graph and cannot "
                    "reach this one)")
            return result
        anchor = anchors[0]
        query_state, query_valid = anchor.args[:2]
        drivers = [resolved[i] for i in self._pick_layers(len(resolved))]
        result.retrieval_layers = tuple(d.layer for d in drivers)
        for slot, driver in enumerate(drivers):
            with graph.inserting_before(driver.node):
                graph.call_function(RECORD, (query_state, query_valid, driver.query, slot))
        for s in resolved:
            if s.reason is None and s.q_len > self.max_sparse_q_len:
                s.reason = f"prefill ({s.q_len} query tokens): dense and exact by design"
            elif s.reason is None and s.q_len > self.budget:
                s.reason = f"{s.q_len} query tokens do not fit a budget of {self.budget}"
        decode = [s for s in resolved if s.reason is None]
        result.phase = "decode" if decode else "prefill"
        if not decode:
            return result
        reason = self._drivers_unusable(drivers)
        if reason is not None:
            for s in decode:
                s.reason = reason
            return result
        first = drivers[0]
        selections: dict[int, fx.Node] = {}
        for window in sorted({s.window or 0 for s in decode}, reverse=True):
            with graph.inserting_after(anchor):
                selections[window] = graph.call_function(SELECT, (
                    query_state, query_valid, [d.key_cache for d in drivers], first.length,
                    first.q_len, self.budget, self.sink_tokens, self.recent_window, first.scale,
                    window))
        result.selection_inserted = True
        result.selections = [selections[w] for w in sorted(selections)]
        for s in decode:
            self._rewrite_site(graph, s, selections[s.window or 0], self.kernel)
        result.rewritten = len(decode)
        graph.eliminate_dead_code(is_impure_node=keeps_side_effects)
        graph.lint()
        return result

    @staticmethod
    def _drivers_unusable(drivers: list[AttentionSite]) -> str | None:
        for d in drivers:
            if d.reason is not None:
                return f"retrieval layer {d.layer} cannot drive a selection: {d.reason}"
            if d.key_cache.op != "placeholder" or d.length.op != "placeholder":
                return "the KV store is allocated inside this graph (first call on a fresh cache)"
        if len({(d.scale, d.q_len) for d in drivers}) != 1:
            return "retrieval layers differ in scale or query length"
        return None

    @staticmethod
    def _rewrite_site(graph: fx.Graph, site: AttentionSite, selection: fx.Node, kernel: str) -> None:
        with graph.inserting_before(site.node):
            sparse = graph.call_function(SPARSE, (
                site.query, site.key_cache, site.value_cache, selection, site.length,
                site.attn_mask, site.scale, kernel, site.soft_cap, site.window or 0))
        sparse.meta.update({k: v for k, v in site.node.meta.items() if k in ("example_value", "val", "stack_trace", "nn_module_stack")})
        site.node.replace_all_uses_with(sparse)
        graph.erase_node(site.node)
        site.node = sparse


def keeps_side_effects(node: fx.Node) -> bool:
    """Dead-code test for :meth:`torch.fx.Graph.eliminate_dead_code`: FX's own purity test,
    plus any op whose schema mutates an argument. torch 2.11 treats a call through an
    ``OpOverloadPacket`` (``torch.ops.specontext.kv_write(...)``, as dynamo records it) as
    pure, so without this the decode graph lost every KV-store write (seen on CUDA)."""
    if node.is_impure():
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, name)._schema for name in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        schemas = [target._schema]
    else:
        return False
    return any(schema.is_mutable for schema in schemas)
