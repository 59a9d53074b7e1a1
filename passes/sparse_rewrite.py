"""The rewrite pass: dense attention over a SpeContext KV store -> sparse attention.

For a graph whose matched sites (see :mod:`.sites`) have single-token (decode) queries:

1. let the step's *selection head* (:mod:`.heads`: the training-free lagged query,
   :mod:`.head_lagged`, or a draft head, :mod:`.head_draft`, option ``retrieval_head``)
   insert what it records each step — also in prefill graphs, whose attention stays dense
   and exact — and, in a decode graph, its selection node right after the retrieval anchor
   (layer 0, before any attention): one selection per step, shared by every layer (one per
   distinct sliding window when layers differ: Gemma's alternating sliding/global layers);
2. replace each matched site by ``specontext::sparse_attention`` over that selection; with
   option ``candidates > 1`` (two-stage selection, issue 12) or the page rescue, the
   selection node picks ``ceil(candidates * budget)`` candidates and each site first keeps
   its own top ``budget`` of them (:func:`~..runtime.aten_step.refine_selection`, a direct call; the layer's current
   query).

The pass has no branch on which head it holds: every head implements
:class:`.heads.SelectionHead`.

Sites that do not match stay dense; their reasons are returned and logged.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
from pathlib import Path

import torch
from torch import fx

from ..runtime import aten_step, key_mirror, mla, page_bounds, routes
from ..runtime.protocol import RetrievalAnchor, op_arguments, overloads
from ..runtime.spec import AttentionVariant, StepSpec
from ..runtime.torch_private import custom_graph_pass, effect_of
from .head_draft import DraftHead
from .head_lagged import LaggedQueryHead
from .heads import SelectionHead
from .site_nodes import bias_4d, boolean_source, selection_query, static_capacity
from .sites import KV_WRITE, AttentionSite, example_value, find_attention_sites, is_op, static_int

logger = logging.getLogger(__name__)
CustomGraphPass, get_hash_for_files = custom_graph_pass()

__all__ = ["RewriteResult", "SparseAttentionPass"]

ANCHOR = torch.ops.specontext.retrieval_anchor
SPARSE = torch.ops.specontext.sparse_attention.default
COUNT = aten_step.count_step
COUNT_FALLBACK = aten_step.count_fallback
STORE = aten_step.store_selection
LOAD = aten_step.load_selection
PAGE_SHIFT = page_bounds.shift_from_mask


@dataclasses.dataclass
class RewriteResult:
    """What one run of the pass did to one graph."""

    sites: list[AttentionSite]
    rewritten: int = 0
    phase: str = "none"  # "decode", "prefill" or "none" (no resolved site); see phase_label
    retrieval_layers: tuple[int, ...] = ()
    selection_inserted: bool = False
    selections: list[fx.Node] = dataclasses.field(default_factory=list)
    selection_head: str = "lagged-query"  # or "draft:<folder>" (option retrieval_head)
    rescued: int = 0  # decode sites refining with the page rescue (option page_rescue)
    # what each rewritten site runs, decided once here (runtime/routes.py): route -> sites,
    # and why sites were passed over for a faster route: reason -> sites
    routes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    route_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cpu_kernel_sites: int = 0  # rewritten sites our C++ CPU kernel computes (StepSpec.cpu_kernel)

    @property
    def total(self) -> int:
        return len(self.sites)

    def fallbacks(self) -> list[tuple[int | None, str]]:
        """(layer, reason) of every site left dense."""
        return [(s.layer, s.reason) for s in self.sites if s.reason]

    @property
    def phase_label(self) -> str:
        """``phase`` for log lines: "decode", "prefill", "graph without attention", or, when
        no site's KV store was resolved (``phase`` "none"), "graph without a resolved KV store"."""
        if self.phase != "none":
            return self.phase
        return "graph without a resolved KV store" if self.sites else "graph without attention"

    @staticmethod
    def site_label(site: AttentionSite) -> str:
        """"layer N", or "unresolved store (node NAME)" for a site whose KV write was not found."""
        return f"layer {site.layer}" if site.layer is not None else f"unresolved store (node {site.node.name})"


def _page_bounds_of(site: AttentionSite) -> tuple[list, fx.Node | None, int] | None:
    """``([page_min, page_max], page_shift, page_tokens)`` that the site's ``kv_write`` keeps
    current in this graph, or None (no write here, or a store without page bounds)."""
    if site.write is None:
        return None
    args = op_arguments(site.write, KV_WRITE)
    bounds, tokens = args.get("page_bounds") or [], args.get("page_tokens", 0)
    if len(bounds) != 2 or not isinstance(tokens, int) or tokens <= 0:
        return None
    return list(bounds), args.get("page_shift"), tokens


def _align_pages_to_rows(graph: fx.Graph, resolved: list[AttentionSite]) -> None:
    """Before the graph's first store write, ``page_shift_from_mask``: at a prompt's first
    write each row's pages start at its first real token, read from the mask of a
    full-attention site (a sliding window's mask hides more than the padding), so a
    left-padded row's page bounds and page rescue are those of its prompt alone; with no mask
    every row's shift becomes 0. Only where the stores keep bounds with a shared shift and
    some site attends fully (a capacity dynamo made symbolic is read in the graph: never a
    decision from a traced size); the caller runs it on the graph
    that holds the step's first store write (prefill graphs included: the bounds are
    written there)."""
    full = [s for s in resolved if s.window == 0]
    bounds = next((b for b in map(_page_bounds_of, resolved) if b is not None), None)
    shift = None if bounds is None else bounds[1]
    if shift is None or not full:
        return
    mask = full[0].attn_mask if isinstance(full[0].attn_mask, fx.Node) else None
    order = {n: i for i, n in enumerate(graph.nodes)}
    write = min((n for n in graph.nodes if is_op(n, KV_WRITE)), key=order.__getitem__)
    if order[mask or write] > order[write] or order[shift] > order[write]:
        return  # the mask is built after the first write: leave the shift as it is
    capacity = static_capacity(full[0])
    store = next((s.key_cache for s in full if order.get(s.key_cache, len(order)) < order[write]), None)
    if capacity is None and store is None:
        return  # symbolic, and every full-attention store is allocated after the first write (GPT-OSS's first call)
    with graph.inserting_before(write):
        if capacity is None:  # symbolic (a cache of another length): the store's size, read in the graph
            capacity = graph.call_method("size", (store, -2))
        graph.call_function(PAGE_SHIFT, (shift, write.args[2], mask, capacity, bounds[2]))


def decide_query_lengths(graph: fx.Graph, longest: int) -> int:
    """A step's query length that dynamo made symbolic (a step of another length than the
    previous one, automatic dynamic shapes) is decided here, against the option
    ``max_sparse_q_len`` (``longest``), by a guard on the graph: a length the user declared
    sparse (``<= longest``) is guarded equal to its value, so this graph is that step's and is
    rewritten sparse as with static shapes (another declared length compiles its own graph);
    a longer one is guarded ``> longest``, so the graph, dense prefill by design, never serves
    a declared step. Without it one graph served both, dense. With ``longest == 1`` nothing is
    decided: dynamo never makes a one-token length symbolic.

    Returns how many symbolic lengths were decided; one that cannot be guarded (no hint) is
    counted (``symbolic_query_len_dense``) and warned, naming ``dynamic=False``."""
    if longest <= 1:
        return 0
    decided, seen = 0, set()
    for write in (n for n in graph.nodes if is_op(n, KV_WRITE)):
        key = op_arguments(write, KV_WRITE).get("key")
        value = key.meta.get("example_value", key.meta.get("val")) if isinstance(key, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 4 or not isinstance(value.shape[2], torch.SymInt):
            continue
        length = value.shape[2]
        if static_int(length) is not None or length.node.expr in seen:
            continue
        seen.add(length.node.expr)
        try:
            if length <= longest:  # a guard on the graph: its outcome holds for every call of it
                int(length)  # guarded equal to its value: static from here on (sites.static_int)
            decided += 1
        except Exception:  # noqa: BLE001 - no hint to decide with: dense, counted and said
            from ..runtime.torch_private import counters

            counters["specontext"]["symbolic_query_len_dense"] += 1
            logger.warning("specontext: a step's query length is symbolic (dynamo made it so) and could not be "
                           "decided against max_sparse_q_len=%d: its graph stays dense. Compile with "
                           "torch.compile(..., dynamic=False) to keep declared multi-token steps sparse", longest)
    return decided


def _sources() -> tuple[str, ...]:
    """The files whose code decides what the rewritten graph computes: this folder (the passes)
    and the runtime's step functions and ops."""
    root = Path(__file__).resolve().parent
    return tuple(str(p) for p in sorted(root.glob("*.py")) + sorted((root.parent / "runtime").glob("*.py")))



def make_head(retrieval_layers: tuple[int, ...] | None, retrieval_head: str | None,
              selection_keys: str = key_mirror.DEFAULT_SELECTION_KEYS) -> SelectionHead:
    """The head the options name: a draft head for ``retrieval_head`` (a resolved folder),
    else the lagged queries of ``retrieval_layers`` (scored over ``selection_keys``)."""
    if retrieval_head is not None:
        return DraftHead(retrieval_head)
    return LaggedQueryHead(retrieval_layers, selection_keys)


class SparseAttentionPass(CustomGraphPass):
    """Callable FX pass with a stable identity (``uuid``) covering its code and options.

    Args:
        step: the decode step's :class:`~..runtime.spec.StepSpec` (budget, candidates, sinks,
            recent window, guard, page rescue, dense shortcut, kernel); each site gets it
            with its store's page size (:meth:`~..runtime.spec.StepSpec.for_store`) and its
            own :class:`~..runtime.spec.AttentionVariant`.
        retrieval_layers: layers whose previous-step queries drive the selection; negative
            counts from the end; None = :func:`default_retrieval_layers`.
        max_sparse_q_len: longest step (tokens) rewritten as sparse; longer = prefill.
        retrieval_head: resolved folder of a draft retrieval head, or None (lagged query).
        dense_layers: decoder layers (negative counts from the end) whose decode sites are
            left dense and exact (their reason says so); they may still drive the selection.
        rescue_layers: decoder layers (negative counts from the end) whose sites refine with
            the page rescue (when ``step`` has one); None = every layer.
        dense_below: a plain site whose store holds at most this many tokens attends densely
            over it (option ``dense_below``; 0 = off).
        selection_keys: ``"store"`` or ``"int8"``: the lagged-query selection's CPU kernel
            scores the int8 copy of the retrieval layers' keys that a cache created with
            ``selection_keys="int8"`` keeps (:mod:`..runtime.key_mirror`; option
            ``selection_keys``).

    A site whose store keeps no page bounds (MLA, Hugging Face's StaticCache, a cache built
    with ``page_tokens=0``) refines without the page rescue (at ``candidate_slots ==
    budget``: the shared selection, no refinement), logged.
    """

    def __init__(self, step: StepSpec, retrieval_layers: tuple[int, ...] | None = None, max_sparse_q_len: int = 1,
                 retrieval_head: str | None = None, dense_layers: tuple[int, ...] = (),
                 rescue_layers: tuple[int, ...] | None = None, dense_below: int = 0,
                 selection_keys: str = "store"):
        self.step = step
        self.selection_keys = selection_keys
        self.dense_below = dense_below
        self.retrieval_layers, self.max_sparse_q_len = retrieval_layers, max_sparse_q_len
        self.retrieval_head, self.dense_layers = retrieval_head, tuple(dense_layers)
        self.rescue_layers = rescue_layers
        self._rescued: frozenset[int] | None = None  # rescue_layers resolved against the model's layer count
        self._specs: dict[int, StepSpec] = {}  # each site's spec, decided once per graph (id of the site)

    @classmethod
    def from_config(cls, config) -> SparseAttentionPass:
        """The pass of a :class:`~..config.SpeContextConfig`."""
        select = config.selection
        return cls(StepSpec.from_config(config), select.retrieval_layers, select.max_sparse_q_len,
                   select.retrieval_head, select.dense_layers, select.rescue_layers, select.dense_below,
                   select.selection_keys)

    def uuid(self) -> str:
        """torch's hash of the sources (inductor's ``get_hash_for_files``: :func:`~..runtime.torch_private.custom_graph_pass`)
        and of the options: the same inputs rewrite to the same graph."""
        options = repr((self.step, self.retrieval_layers, self.max_sparse_q_len, self.retrieval_head,
                        self.dense_layers, self.rescue_layers, self.dense_below, self.selection_keys))
        return f"specontext-sparse-{get_hash_for_files(_sources(), options).hex()[:24]}"

    def __call__(self, graph: fx.Graph) -> RewriteResult:
        self._specs = {}
        decide_query_lengths(graph, self.max_sparse_q_len)
        sites = find_attention_sites(graph)
        result = RewriteResult(sites=sites)
        resolved = sorted((s for s in sites if s.layer is not None), key=lambda s: s.layer)
        anchor = RetrievalAnchor.first(graph)
        _drop_later_anchors(graph, anchor)
        if not resolved:
            return result
        if anchor is None:
            for s in sites:
                s.reason = s.reason or (
                    "no retrieval anchor in this graph (a graph break split the step, and the cache "
                    "emits none past its first layer: Hugging Face's StaticCache)")
            return result
        anchored = RetrievalAnchor.of(anchor)
        if anchored.layer != 0:  # a graph after a graph break: the step's selection is stored
            return self._continue_step(graph, result, resolved, anchor, anchored)
        _align_pages_to_rows(graph, resolved)
        self._rescued = _resolve_layers("rescue_layers", self.rescue_layers, len(anchored.windows() or resolved))
        head = make_head(self.retrieval_layers, self.retrieval_head, self.selection_keys)
        failed = head.prepare(graph, anchor, anchored, resolved)
        result.selection_head, result.retrieval_layers = head.label, head.retrieval_layers
        decode = self._decode_sites(resolved)
        result.phase = "decode" if decode or self._decode_shaped(resolved) else "prefill"
        decode = head.serves(decode)
        if not decode:
            return result
        reason = failed or head.unusable(decode)
        if reason is not None:
            for s in decode:
                s.reason = reason
            return result
        selections: dict[int, fx.Node] = {}
        unused = self._selection_unused(graph, decode, anchored)
        if not unused:
            for window in sorted({s.window or 0 for s in decode}, reverse=True):
                mask = next(s.attn_mask for s in decode if (s.window or 0) == window)
                mask = mask if isinstance(mask, fx.Node) else None
                selections[window] = head.select(graph, anchor, self.step, window, mask, decode)
            result.selection_inserted = True
            result.selections = [selections[w] for w in sorted(selections)]
            ready = head.ready(graph, result.selections[0])
            if ready is not None:
                with graph.inserting_after(ready):
                    graph.call_function(COUNT_FALLBACK, (anchored.stats, ready))
        # when made, the selection is kept for later graphs even if this graph's sites all
        # stay dense by option: the graphs after a break read it
        sparse = self._without_dense_layers(decode, len(anchored.windows() or resolved))
        for s in sparse:
            # a dense site reads every slot (option dense_below: its store may be larger than the selection)
            selection = _every_slot(graph, s) if unused or self._dense_store(s) else selections[s.window or 0]
            dense = None
            if self._refines(s):
                selection, dense = self._insert_refine(graph, s, selection, anchored.stats)
            self._rewrite_site(graph, s, selection, dense, result)
        result.rewritten = len(sparse)
        result.rescued = self._log_rescue(sparse)
        if not unused:
            self._store_for_later_graphs(graph, anchored, selections, decode)
        dense = sum(self._dense_store(s) for s in sparse)
        with graph.inserting_after(anchor):
            graph.call_function(COUNT, (anchored.stats, [1, len(sparse), len(sparse) - dense, dense, 0,
                                                         result.rescued]))
        graph.eliminate_dead_code(is_impure_node=keeps_side_effects)
        graph.lint()
        return result

    def _selection_unused(self, graph: fx.Graph, decode: list[AttentionSite], anchored: RetrievalAnchor) -> bool:
        """Whether no site would read the step's selection, so the pass leaves it out (issue
        51: it cost a dense step about 5 ms at 8K, scores over 8 layers' keys and a sort):
        every decode site takes the dense shortcut over its whole store (a static fact:
        :meth:`_dense_store`, no refinement), and this graph holds the whole step of a
        full-attention model (as many KV writes as the cache has layers, no sliding window),
        so no graph after a break reads it either. Logged at INFO."""
        windows = anchored.windows()
        writes = sum(1 for n in graph.nodes if is_op(n, KV_WRITE))
        unused = (windows is not None and writes >= len(windows) and not any(windows) and bool(decode)
                  and all(self._dense_store(s) and not self._refines(s) for s in decode))
        if unused:
            logger.info("specontext: every decode site attends densely over its whole store (budget %d >= its "
                        "capacity, or dense_below=%r): no selection in this step", self.step.budget, self.dense_below)
        return unused

    def _without_dense_layers(self, decode: list[AttentionSite], num_layers: int | None) -> list[AttentionSite]:
        """The decode sites the option ``dense_layers`` does not keep dense; those it keeps get
        their reason (negative layers count from ``num_layers``, the model's KV layers)."""
        if not self.dense_layers:
            return decode
        dense = _resolve_layers("dense_layers", self.dense_layers, num_layers)
        for s in decode:
            if s.layer in dense:
                s.reason = "option dense_layers keeps this layer dense: dense and exact by choice"
        return [s for s in decode if s.reason is None]

    def _decode_shaped(self, resolved: list[AttentionSite]) -> bool:
        """Whether the graph's sites have one-token (decode-step) queries though none can be
        rewritten (their reasons then describe a decode graph, not a prefill)."""
        return any(s.q_len == 1 for s in resolved)

    def _decode_sites(self, resolved: list[AttentionSite]) -> list[AttentionSite]:
        """The sites a selection can serve; longer steps (prefill) get their reason."""
        for s in resolved:
            if s.reason is None and s.q_len > self.max_sparse_q_len:
                s.reason = f"prefill ({s.q_len} query tokens): dense and exact by design"
            elif s.reason is None and s.q_len > self.step.budget:
                s.reason = f"{s.q_len} query tokens do not fit a budget of {self.step.budget}"
            elif s.reason is None and s.mla is not None and (s.soft_cap or s.window or s.position_bias is not None):
                s.reason = ("MLA with a soft cap, a sliding window or a position bias is not built "
                            "(the latent attention has none of them): dense and exact")
        return [s for s in resolved if s.reason is None]

    @staticmethod
    def _store_for_later_graphs(graph: fx.Graph, anchored: RetrievalAnchor, selections: dict, decode: list) -> None:
        """When this graph holds fewer KV layers than the model (a graph break follows), keep
        the step's selection in the cache's ``selection_state`` for the later graphs (one
        window only: full attention)."""
        windows = anchored.windows()
        writes = sum(1 for n in graph.nodes if is_op(n, KV_WRITE))
        state = anchored.selection_state
        if windows is None or writes >= len(windows) or not isinstance(state, fx.Node) or list(selections) != [0]:
            return
        with graph.inserting_after(selections[0]):
            graph.call_function(STORE, (state, selections[0]))

    def _continue_step(self, graph: fx.Graph, result: RewriteResult, resolved: list, anchor: fx.Node,
                       anchored: RetrievalAnchor) -> RewriteResult:
        """A graph that starts at KV layer ``anchored.layer > 0`` (a graph break split the
        step): its decode sites read the selection the step's first graph stored in
        ``selection_state`` (same positions, as if the step were one graph)."""
        decode = self._decode_sites(resolved)
        result.phase = "decode" if decode or self._decode_shaped(resolved) else "prefill"
        if not decode:
            return result
        reason = make_head(self.retrieval_layers, self.retrieval_head).after_break()
        if reason is None and not isinstance(anchored.selection_state, fx.Node):
            reason = "after a graph break: the cache carries no selection state"
        elif reason is None and (any(s.window for s in decode) or any(w for w in (anchored.windows() or []))):
            reason = "after a graph break only full-attention models carry the selection over (sliding windows)"
        capacity = static_capacity(decode[0])
        if reason is None and capacity is None:
            reason = ("after a graph break: the store's capacity is symbolic (dynamo made it so on a "
                      "recompile); compile with torch.compile(..., dynamic=False) to keep it sparse")
        if reason is not None:
            for s in decode:
                s.reason = reason
            return result
        decode = self._without_dense_layers(decode, len(anchored.windows() or []) or None)
        self._rescued = _resolve_layers("rescue_layers", self.rescue_layers, len(anchored.windows() or []) or None)
        if not decode:  # every site here stays dense by option
            return result
        slots = max(decode[0].q_len, min(self.step.candidate_slots, capacity))
        with graph.inserting_after(anchor):
            selection = graph.call_function(LOAD, (anchored.selection_state, slots))
        result.selection_inserted = True
        result.selections = [selection]
        for s in decode:
            chosen, dense = (_every_slot(graph, s) if self._dense_store(s) else selection), None
            if self._refines(s):
                chosen, dense = self._insert_refine(graph, s, selection, anchored.stats)
            self._rewrite_site(graph, s, chosen, dense, result)
        result.rewritten = len(decode)
        result.rescued = self._log_rescue(decode)
        dense = sum(self._dense_store(s) for s in decode)
        with graph.inserting_after(anchor):  # the step itself was counted by its first graph
            graph.call_function(COUNT, (anchored.stats, [0, len(decode), len(decode) - dense, dense, 0,
                                                         result.rescued]))
        graph.eliminate_dead_code(is_impure_node=keeps_side_effects)
        graph.lint()
        return result

    def _dense_store(self, site: AttentionSite) -> bool:
        """Whether the rewritten site attends densely over its store, decided here from static
        shapes (the budget covers the store's capacity, or the capacity is at most option
        ``dense_below``) and passed to the op as its spec's ``dense_shortcut``, so
        the path counters and the path taken agree (a symbolic capacity gathers)."""
        capacity = static_capacity(site)
        plain = (self.step.dense_shortcut and site.soft_cap is None and not site.window and site.mla is None
                 and site.sinks is None and capacity is not None)
        # option dense_below: a store this small reads faster whole than through the selection
        return plain and (self.step.budget >= capacity or capacity <= self.dense_below)

    def _site_spec(self, site: AttentionSite) -> StepSpec:
        """The step's spec at this site: its store's page size (0 = no page bounds, or the
        rescue does not apply here), the dense shortcut where the site takes it, and whether
        our CPU kernel computes it; decided once per site (its refinement and its attention
        read the same spec)."""
        if id(site) not in self._specs:
            self._specs[id(site)] = self._decide_spec(site)
        return self._specs[id(site)]

    def _decide_spec(self, site: AttentionSite) -> StepSpec:
        rescue = self._rescue_of(site)
        spec = self.step.for_store(rescue[1] if rescue is not None else 0)
        spec = dataclasses.replace(spec, dense_shortcut=self._dense_store(site))
        return dataclasses.replace(spec, cpu_kernel=self._cpu_kernel(site, spec, rescue))

    def _cpu_kernel(self, site: AttentionSite, spec: StepSpec, rescue: tuple[list, int] | None) -> bool:
        """Whether our C++ CPU kernel computes the site (``StepSpec.cpu_kernel``, decided here
        by :func:`~..runtime.routes.cpu_kernel` from the site's example values): on the dense
        route (the dense shortcut without offload) the dense kernel; at a refined site without
        the guard or learned sinks (the lowering makes its refinement and attention one body)
        the refine kernel. A site with ALiBi's bias (an additive mask), an MLA site, or a value
        the pass cannot see keeps the torch bodies."""
        dense = spec.dense_shortcut and not spec.offload
        refined = self._refines(site) and spec.min_coverage == 0 and site.sinks is None
        if not (dense or refined) or site.mla is not None or site.position_bias is not None:
            return False
        query, key_cache, value_cache = (example_value(n) for n in (site.query, site.key_cache, site.value_cache))
        attn_mask = example_value(site.attn_mask)
        pages = [example_value(n) for n in rescue[0]] if rescue is not None else []
        if (any(v is None for v in (query, key_cache, value_cache)) or (site.attn_mask is not None and attn_mask is None)
                or any(v is None for n, v in zip(rescue[0] if rescue else [], pages) if n is not None)):
            return False
        capacity = static_capacity(site)
        slots = max(site.q_len or 1, min(self.step.candidate_slots, capacity)) if refined and capacity else None
        return routes.cpu_kernel(query, (key_cache, value_cache), attn_mask, spec, _variant(site), dense=dense,
                                 slots=slots, pages=tuple(pages))

    def _refines(self, site: AttentionSite) -> bool:
        """Whether the site keeps its own ``budget`` of the step's candidates: the candidate
        set is larger than the budget (option ``candidates > 1``) or the page rescue adds to
        it, and the store may hold more than ``budget`` tokens (a symbolic capacity counts as
        larger)."""
        capacity = static_capacity(site)
        wider = self.step.candidate_slots > self.step.budget or self._rescue_of(site) is not None
        return wider and not (capacity is not None and capacity <= self.step.budget) and not self._dense_store(site)

    def _rescue_of(self, site: AttentionSite) -> tuple[list, int] | None:
        """``([page_min, page_max, page_shift], page_tokens)`` when the site refines with the
        page rescue: the option is on, the site is no MLA site and its store keeps page bounds
        (its ``kv_write`` here updates them)."""
        if self.step.rescue_tokens <= 0 or site.mla is not None or site.write is None or not self._rescues(site):
            return None
        bounds = _page_bounds_of(site)
        if bounds is None:
            return None
        (page_min, page_max), shift, tokens = bounds
        return [page_min, page_max, shift], tokens

    def _rescues(self, site: AttentionSite) -> bool:
        """Whether option ``rescue_layers`` names the site's layer (None: every layer)."""
        return self.rescue_layers is None or self._rescued is not None and site.layer in self._rescued

    def _below_store(self, site: AttentionSite) -> bool:
        """Whether the candidates stay below the store's capacity (a symbolic one counts as
        larger): else the refinement ranks every position in place and reads no bounds
        (:func:`~..runtime.aten_step.refine_coverage`)."""
        capacity = static_capacity(site)
        return capacity is None or self.step.candidate_slots < capacity

    def _log_rescue(self, decode: list[AttentionSite]) -> int:
        """Refined decode sites with the page rescue; logs those the rescue, or the guard, misses
        (a site whose store the budget covers needs neither)."""
        rescued = [s for s in decode if self._refines(s) and self._rescue_of(s) is not None and self._below_store(s)]
        missed = [s for s in decode if self.step.rescue_tokens > 0 and self._rescues(s) and self._rescue_of(s) is None]
        covered = {id(s) for s in decode if (c := static_capacity(s)) is not None and c <= self.step.budget}
        unguarded = [s for s in decode if self.step.min_coverage > 0 and not self._refines(s)
                     and id(s) not in covered]
        if unguarded:
            logger.warning("specontext: the fidelity guard (min_coverage) is off at %d decode site(s) (layers %s): "
                           "they do not refine (candidates=1 and their store keeps no page bounds for the rescue); "
                           "set candidates=2 to guard them", len(unguarded), [s.layer for s in unguarded])
        if missed:
            logger.info("specontext: page_rescue is off at %d decode site(s) (layers %s): their store keeps no "
                        "page bounds (MLA, Hugging Face's StaticCache, a cache built with page_tokens=0); they "
                        "use the candidates alone (the shared selection at candidates=1)",
                        len(missed), [s.layer for s in missed])
        return len(rescued)

    def _insert_refine(self, graph: fx.Graph, site: AttentionSite, selection: fx.Node, stats: fx.Node
                       ) -> tuple[fx.Node, fx.Node | None]:
        """``refine_selection`` before the site; returns the nodes of its kept positions and,
        with the guard on, of its run-dense decision (else None)."""
        query = selection_query(graph, site)
        mask = _biased_mask(graph, site)
        with graph.inserting_before(site.node):
            rescue = self._rescue_of(site)
            # looked up when the pass runs: a wrapper of it set before compiling is what runs
            keys = (site.key_cache, site.value_cache) if site.mla is not None else site.key_cache  # MLA: two stores
            refine = graph.call_function(aten_step.refine_selection, (
                query, keys, selection, site.length, mask, rescue[0] if rescue is not None else [],
                self._site_spec(site), _variant(site)))
            kept = graph.call_function(operator.getitem, (refine, 0))
            dense = None
            if self.step.min_coverage > 0:
                dense = graph.call_function(operator.getitem, (refine, 1))
                graph.call_function(aten_step.count_guard, (stats, dense))
        return kept, dense

    def _attention_call(self, site: AttentionSite, selection: fx.Node, mask, dense: fx.Node | None,
                        result: RewriteResult):
        """``(target, args)`` of a (non-MLA) site's attention over ``selection``: the
        ``specontext::sparse_attention`` op with the site's route on its spec (dense over the
        store, generated kernel, gather: :meth:`_route`), or for a site the op does not serve,
        its torch step function called directly: with the fidelity guard's decision ``dense``,
        :func:`~..runtime.aten_step.guarded_attention`; with learned sink logits,
        :func:`~..runtime.aten_step.sinks_attention`."""
        variant = _variant(site)
        store = (site.key_cache, site.value_cache)
        if dense is not None:
            result.routes["guarded"] += 1
            return aten_step.guarded_attention, (site.query, store, selection, site.length, mask, variant, dense,
                                                 site.sinks)
        if site.sinks is not None:
            result.routes["sinks"] += 1
            return aten_step.sinks_attention, (site.query, store, selection, site.length, mask, variant, site.sinks)
        spec, mask = self._route(site, mask, result)
        return SPARSE, (site.query, site.key_cache, site.value_cache, selection, site.length, mask, spec, variant)

    def _route(self, site: AttentionSite, mask, result: RewriteResult) -> tuple[StepSpec, fx.Node | None]:
        """The site's spec with its route (:func:`~..runtime.routes.decide`, from the site's
        example values), counted in ``result`` with the reason a faster route was passed over,
        and the mask the site's attention reads: on the kernel route a float mask made from a
        bool one (:func:`~.site_nodes.boolean_source`, Hugging Face's eager masks) is replaced
        by that bool mask, which the kernel folds into the selection; elsewhere ``mask``."""
        spec = self._site_spec(site)  # its dense_shortcut: the option is on and the selection covers the store
        original, mask = mask, (boolean_source(mask) or mask) if self.step.kernel != "torch" else mask
        query, key_cache = example_value(site.query), example_value(site.key_cache)
        attn_mask = example_value(mask) if mask is not None else None
        if query is None or key_cache is None or (mask is not None and attn_mask is None):
            decision = routes.Decision("dense" if spec.dense_shortcut else "gather", "no example values to decide from")
        else:
            decision = routes.decide(query, key_cache, attn_mask, spec.dense_shortcut, spec,
                                     _variant(site, latent=site.mla is not None))
        result.routes[decision.route] += 1
        result.cpu_kernel_sites += spec.cpu_kernel
        if decision.reason is not None:
            result.route_reasons[decision.reason] += 1
        return dataclasses.replace(spec, route=decision.route), (mask if decision.route == "kernel" else original)

    def _rewrite_site(self, graph: fx.Graph, site: AttentionSite, selection: fx.Node, dense: fx.Node | None,
                      result: RewriteResult) -> None:
        latent = None
        if site.mla is not None:
            query = selection_query(graph, site)
            variant = _variant(site, latent=True)
            with graph.inserting_before(site.node):
                if dense is None and site.sinks is None:
                    spec, mask = self._route(site, site.attn_mask, result)
                    latent = graph.call_function(SPARSE, (
                        query, site.key_cache, site.value_cache, selection, site.length, mask, spec, variant))
                else:  # no kernel serves these: the torch step function, called directly
                    result.routes["guarded" if dense is not None else "sinks"] += 1
                    latent = graph.call_function(mla.attend_latent, (
                        query, (site.key_cache, site.value_cache), selection, site.length, site.attn_mask, variant,
                        dense, site.sinks))
                sparse = graph.call_function(mla.up_project, (latent, site.mla.weight, site.mla.nope_dim))
            for node in site.mla.scratch:  # in-place copies filling the up-projected keys: now dead
                graph.erase_node(node)
        else:
            mask = _biased_mask(graph, site)
            with graph.inserting_before(site.node):
                sparse = graph.call_function(*self._attention_call(site, selection, mask, dense, result))
        keep = ("stack_trace", "nn_module_stack") + (() if site.position_bias is not None else ("example_value", "val"))
        sparse.meta.update({k: v for k, v in site.node.meta.items() if k in keep})
        result = sparse
        if site.position_bias is not None:  # BLOOM's 3-D layout: the output is [b * h, q_len, d]
            out = site.node.meta.get("example_value", site.node.meta.get("val"))
            with graph.inserting_before(site.node):
                result = graph.call_method("reshape", (sparse, -1, *out.shape[1:]))  # b * h may be symbolic
        site.node.replace_all_uses_with(result)
        graph.erase_node(site.node)
        site.node = sparse if latent is None else latent  # the attention (MLA: before its up-projection)


def _every_slot(graph: fx.Graph, site: AttentionSite) -> fx.Node:
    """Before ``site``: int64 ``[batch, num_kv_heads, capacity]`` naming every slot of its store
    (an expanded ``arange``, nothing read): the selection a dense-shortcut site gets when the
    step makes none (:meth:`SparseAttentionPass._selection_unused`); the op's static
    ``covers_store`` test then sends it over the store."""
    with graph.inserting_before(site.node):
        return graph.call_function(aten_step.every_slot, (site.key_cache,))


def _resolve_layers(option: str, layers: tuple[int, ...] | None, num_layers: int | None) -> frozenset[int] | None:
    """The decoder layers an option (``dense_layers``, ``rescue_layers``) names, negative ones
    counted from ``num_layers`` (the model's KV layers); None for None. A layer the model lacks,
    or a negative one while that count is unknown, names nothing (logged as a warning)."""
    if layers is None:
        return None
    unknown = [j for j in layers if num_layers is None and j < 0
               or num_layers is not None and not -num_layers <= j < num_layers]
    if unknown:
        logger.warning("specontext: %s %s name no KV layer of this model (%s): they have no effect; "
                       "use layers in [-L, L)", option, unknown,
                       f"L = {num_layers}" if num_layers is not None else "its layer count is unknown in "
                       "this graph, so negative layers cannot be resolved")
    return frozenset(j + num_layers if j < 0 and num_layers is not None else j for j in layers)


def _variant(site: AttentionSite, latent: bool = False) -> AttentionVariant:
    """The site's attention variant from its matched constants (scale, soft cap, window);
    ``latent``: an MLA site's attention in the latent space (its ``nope_dim``)."""
    if latent:
        return AttentionVariant(site.scale, nope_dim=site.mla.nope_dim)
    return AttentionVariant(site.scale, site.soft_cap, site.window or 0)


def _biased_mask(graph: fx.Graph, site: AttentionSite) -> fx.Node | None:
    """What the sparse op adds to the logits: the mask, plus the ALiBi bias when the site has one
    (``[b, h, q_len, capacity]`` float; gathered at the selected positions like a mask). The
    sum is made once, after both, for every site with the same bias and mask."""
    if site.position_bias is None:
        return site.attn_mask
    bias = bias_4d(graph, site)
    if site.attn_mask is None:
        return bias
    for user in bias.users:  # one sum per step, shared by the layers (and their refinements)
        if user.meta.get("specontext_biased_mask") and user.args[1] is site.attn_mask:
            return user
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_after(max(bias, site.attn_mask, key=order.__getitem__)):
        total = graph.call_function(operator.add, (bias, site.attn_mask))
    total.meta["specontext_biased_mask"] = True
    return total


def _drop_later_anchors(graph: fx.Graph, first: fx.Node | None) -> None:
    """The cache emits a retrieval anchor at every KV layer so that a graph after a graph
    break finds one; only a graph's first counts (sites read its layer and windows), so the
    others go: no per-layer no-op op call on the eager op chain."""
    for node in [n for n in graph.nodes if is_op(n, ANCHOR) and n is not first]:
        graph.erase_node(node)


def keeps_side_effects(node: fx.Node) -> bool:
    """Dead-code test for :meth:`torch.fx.Graph.eliminate_dead_code`: FX's own purity test
    (:meth:`torch.fx.Node.is_impure`), which keeps our step functions that change tensors in
    place (each registered with :func:`torch.fx.node.has_side_effect` where it is defined),
    plus two cases FX has left out:

    * an op whose schema mutates an argument, or that declares an effect
      (``torch._library.effects``, e.g. every op taking an opaque reference object such as
      the KV-offload manager), called through its ``OpOverloadPacket``
      (``torch.ops.specontext.kv_write(...)``, as dynamo records it): torch 2.11 called that
      pure and the decode graph lost every KV-store write (seen on CUDA); torch 2.13's test
      covers it, older ones (we take torch >= 2.6) do not;
    * an in-place tensor method (``x.copy_(y)``, ``torch.relu_``): dynamo records an in-place
      collective (Hugging Face tensor parallelism's ``all_reduce`` of the row-parallel output)
      as a functional all-reduce plus ``copy_`` back into the input, whose result is unused;
      FX calls that pure (torch 2.13 too)."""
    if node.is_impure():
        return True
    target = node.target
    name = target if node.op == "call_method" else getattr(target, "__name__", None)
    if (node.op in ("call_method", "call_function") and isinstance(name, str) and name.endswith("_")
            and not name.endswith("__") and hasattr(torch.Tensor, name)):
        return True
    return any(op._schema.is_mutable or effect_of(op) is not None for op in overloads(target))
