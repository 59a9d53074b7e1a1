"""The training-free lagged-query selection head (SpeContext section 4): each retrieval layer
records its last query row every step (:func:`~..runtime.aten_step.record_query`), and the next step's
selection node (:func:`~..runtime.scorers.head_select` with the ``"lagged-query"`` scorer, a direct
call) scores every cached token with those queries before layer 0 runs."""

from __future__ import annotations

import logging

from torch import fx

from ..runtime import aten_step, key_mirror, rollback, routes
from ..runtime.protocol import RetrievalAnchor, op_arguments
from ..runtime.retrieval import picked_retrieval_layers
from ..runtime.spec import StepSpec
from ..runtime.torch_private import counters
from .heads import ScoreInputs, SelectionHead
from .site_nodes import bias_4d, selection_query
from .sites import KV_WRITE, AttentionSite, example_value

__all__ = ["LaggedQueryHead"]

logger = logging.getLogger(__name__)

RECORD = aten_step.record_query
HISTORY = rollback.record_rows
RESTORE = rollback.restore


class LaggedQueryHead(SelectionHead):
    """Lagged queries of ``retrieval_layers`` (None = :func:`default_retrieval_layers`;
    negative counts from the end); ``label`` ``"lagged-query"``. ``selection_keys="int8"``:
    the CPU kernel scores the retrieval layers' int8 key rows (:mod:`..runtime.key_mirror`)
    where their stores keep them."""

    label = scorer = "lagged-query"

    def __init__(self, retrieval_layers: tuple[int, ...] | None, selection_keys: str = key_mirror.DEFAULT_SELECTION_KEYS):
        self.layers = retrieval_layers
        self.selection_keys = selection_keys
        self.drivers: list[AttentionSite] = []
        self.anchored: RetrievalAnchor | None = None
        self.restored = False  # the graph's rollback restore (runtime/rollback.py) is inserted

    @property
    def retrieval_layers(self) -> tuple[int, ...]:
        return tuple(d.layer for d in self.drivers)

    def prepare(self, graph: fx.Graph, anchor: fx.Node, anchored: RetrievalAnchor,
                resolved: list[AttentionSite]) -> str | None:
        """Record each fitting retrieval layer's query in its slot of the retrieval state."""
        self.anchored = anchored
        picked = [resolved[i] for i in self._pick(len(resolved))]
        self.drivers = _fitting_drivers(picked, resolved, anchored.query_state)
        if not self.drivers:
            return ("no attention layer's query fits the retrieval state (sized from the first KV "
                    "layer's heads and head size): layers differ in shape")
        for slot, driver in enumerate(self.drivers):
            query = selection_query(graph, driver)
            with graph.inserting_before(driver.node):
                graph.call_function(RECORD, (anchored.query_state, anchored.query_valid, query, slot,
                                             driver.length))
                graph.call_function(HISTORY, (anchored.query_state, anchored.query_valid, query, slot,
                                              driver.length, _store(driver)))
        self.restored = False
        return None

    def serves(self, decode: list[AttentionSite]) -> list[AttentionSite]:
        return _sharing_kv_heads(decode, self.drivers[0]) if self.drivers else decode

    def unusable(self, decode: list[AttentionSite]) -> str | None:
        for d in self.drivers:
            if d.reason is not None:
                return f"retrieval layer {d.layer} cannot drive a selection: {d.reason}"
            if d.key_cache.op != "placeholder" or d.length.op != "placeholder":
                return "the KV store is allocated inside this graph (first call on a fresh cache)"
        if len({(d.scale, d.q_len) for d in self.drivers}) != 1:
            return "retrieval layers differ in scale or query length"
        if len({d.mla is None for d in self.drivers}) != 1:
            return "retrieval layers mix latent (MLA) and per-head KV stores"
        if len({d.position_bias for d in self.drivers}) != 1:
            return "retrieval layers differ in their position bias (ALiBi)"
        return None

    def score_inputs(self, graph: fx.Graph, anchor: fx.Node, mask: fx.Node | None,
                     decode: list[AttentionSite]) -> ScoreInputs:
        """The recorded queries and the retrieval layers' key stores, after the anchor, the
        mask, ALiBi's bias (if any) and the rollback's restore of the slots (inserted once)."""
        first = self.drivers[0]
        bias = bias_4d(graph, first)
        order = {n: i for i, n in enumerate(graph.nodes)}
        after = max((anchor, mask or anchor, bias or anchor), key=order.__getitem__)
        if not self.restored:  # a rollback (crop) left the slots stale: the kept token's query back
            with graph.inserting_after(after):
                after = graph.call_function(RESTORE, (self.anchored.query_state, self.anchored.query_valid,
                                                      first.length, [_store(d) for d in self.drivers]))
            self.restored = True
        return ScoreInputs(after, (self.anchored.query_state, self.anchored.query_valid),
                           [_store(d) for d in self.drivers], first.length, first.q_len, first.scale, bias)

    def cpu_kernel(self, inputs: ScoreInputs, spec: StepSpec) -> bool:
        """Our CPU selection kernel where :func:`~..runtime.routes.selection_kernel` says so,
        from the recorded queries' and key stores' example values (none: the torch body).
        With ``selection_keys="int8"`` and a cache that keeps the int8 keys, the kernel's
        record also carries them (:meth:`with_mirror`)."""
        values = [example_value(n) if isinstance(n, fx.Node) else None for n in (inputs.record[0], *inputs.stores)]
        if any(v is None for v in values):
            return False
        return routes.selection_kernel(values[0], values[1:], spec, inputs.position_bias is not None)

    def with_mirror(self, inputs: ScoreInputs, kernel: bool) -> ScoreInputs:
        """``inputs`` with the retrieval layers' int8 key rows in the record (one ``(key_levels,
        key_scales)`` per store, as each layer's ``kv_write`` in this graph keeps them) where
        the option asks for them and they serve this selection (our CPU kernel; every
        retrieval layer keeps them, in its stores' shape); else ``inputs``, the reason logged
        (the selection then reads the stores)."""
        if self.selection_keys != "int8":
            return inputs
        mirrors = [_mirror_of(d) for d in self.drivers]
        reason = None
        if not kernel:
            reason = "the selection does not run our CPU kernel here (only it reads the int8 rows)"
        elif any(m is None for m in mirrors):
            reason = ("a retrieval layer's store keeps no int8 key rows: create the cache with "
                      "SpeContextCache(..., selection_keys='int8', retrieval_layers=<the same option>) "
                      "(specontext_compile.compile does)")
        elif not key_mirror.applies([tuple(example_value(n) for n in m) for m in mirrors],
                                    [example_value(n) for n in inputs.stores]):
            reason = "the retrieval layers' int8 key rows do not fit their stores"
        if reason is not None:  # off the CPU kernel it is expected (the option's default): debug only
            log = logger.debug if not kernel else logger.info
            log("specontext: selection_keys='int8' not applied, the selection reads the stores: %s", reason)
            counters["specontext"]["selection_keys_fallback"] += 1
            return inputs
        counters["specontext"]["selection_keys_int8"] += 1
        return inputs._replace(record=(*inputs.record, [tuple(m) for m in mirrors]))

    def _pick(self, num_layers: int) -> list[int]:
        return picked_retrieval_layers(self.layers, num_layers)


def _mirror_of(driver: AttentionSite) -> list | None:
    """``[key_levels, key_scales]`` that the layer's ``kv_write`` in this graph keeps, or None."""
    if driver.write is None or driver.mla is not None:
        return None
    mirror = op_arguments(driver.write, KV_WRITE).get("key_mirror") or []
    return list(mirror) if len(mirror) == 2 else None


def _store(driver: AttentionSite):
    """A retrieval layer's key store as the selection reads it (MLA: the store pair)."""
    return (driver.key_cache, driver.value_cache) if driver.mla is not None else driver.key_cache


def _fitting_drivers(picked: list, resolved: list, query_state: fx.Node) -> list:
    """The retrieval layers whose query fits the retrieval state ``[slots, batch, heads, 1,
    width]`` (sized from the first KV layer): ``picked`` when all fit, else the fitting ones
    among them, else the last fitting layer of the graph (models whose layers differ in
    heads or head size, e.g. Gemma 4's global layers); [] when none fits."""
    state = query_state.meta.get("example_value", query_state.meta.get("val")) if isinstance(
        query_state, fx.Node) else None
    if state is None or state.dim() != 5:
        return picked

    def fits(s):
        return s.num_heads == state.shape[2] and s.query_width == state.shape[-1]

    chosen = [d for d in picked if fits(d)]
    if not chosen:
        chosen = [s for s in resolved if fits(s)][-1:]
    return chosen


def _sharing_kv_heads(decode: list, driver: AttentionSite) -> list:
    """The decode sites one selection can serve: those with the retrieval layers' KV head
    count; the others get their reason and stay dense."""
    kept = []
    for s in decode:
        if s.num_kv_heads != driver.num_kv_heads:
            s.reason = (f"{s.num_kv_heads} KV heads, the retrieval layers' selection is for "
                        f"{driver.num_kv_heads} (one selection is shared by every layer)")
        else:
            kept.append(s)
    return kept
