"""The offload scheduling pass: prefetch/wait ops in the rewritten decode graph.

Runs after :mod:`.sparse_rewrite` and only when offload is enabled (the backend's
``device_memory_bytes`` option). For the graph's selection node and each rewritten
``specontext::sparse_attention`` it

1. turns on the ``specontext::offload_plan`` the cache put at layer 0 (the step's adaptive
   plan; it returns each layer's index as a tensor, so no layer's code holds its index);
2. replaces every sparse attention the rewrite pass routed to ``"offload"``
   (``StepSpec.route``, :func:`~..runtime.routes.decide`: every non-MLA site when offload is
   on) by a call of :func:`~..runtime.offload_step.attention`
   (the resident arithmetic on rows read through ``specontext::offload_rows``): resident
   layers compute exactly as before, offloaded ones read their device buffer;
3. inserts ``specontext::offload_prefetch(l)`` ``lead`` layers before layer ``l``'s
   attention, right before layer ``l - lead``'s ``kv_write``, or right after the plan and the
   selection when that is not yet in the graph; the layer's ``offload_rows`` (in its
   attention) waits for the copy, as late as possible;
4. with the two-stage selection (option ``candidates > 1``), a site's indices come from its
   :func:`~..runtime.aten_step.refine_selection`: the prefetch loads the step's *candidates* (known
   before layer 0), the refinement becomes a call of
   :func:`~..runtime.offload_step.refine` (an offloaded layer scores the candidates from its
   device buffer), and the attention reads the kept subset of the buffer.

The graph then holds only run ops (plan, prefetch, row reads) and ordinary step code, so
the backend compiles it with inductor like a resident step (the lowering fuses a refinement
and its attention into :func:`~..runtime.offload_step.refine_and_attend` as it does
resident ones).

``lead`` comes from a cost model (SpeContext section 5: prefetch as early as the selection
allows, overlapped with compute): the expected bytes of one layer's elastic load
(``(1 - overlap) x budget`` rows, paper: > 80% of the selection is reused) divided by the
copy bandwidth, against the estimated compute time of one decode layer (its parameter
bytes / the same bandwidth: decode is memory bound), capped by ``max_inflight``. The
bandwidth is an input (the option ``copy_bandwidth``, or the machine's calibration kept on
disk by ``runtime/calibration.py``), never measured while compiling, and part of the
pass's ``uuid``: the same inputs compile to the same graph.
The placement is checked on the graph's dependency DAG with networkx: a prefetch never goes
before one of its inputs, each wait has a path from its prefetch and to its attention.
The chosen schedule is logged, kept in ``graph_module.meta["specontext_offload_schedule"]``
and visible in graph dumps (the ops carry the layer index).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from pathlib import Path

import networkx as nx
import torch
import torch.fx as fx

from ..runtime import aten_step, offload_step, scorers
from ..runtime import offload_ops as _offload_ops  # noqa: F401  (registers the ops)
from ..runtime.protocol import op_arguments
from ..runtime.torch_private import custom_graph_pass
from .sites import is_op

_, get_hash_for_files = custom_graph_pass()

logger = logging.getLogger(__name__)

__all__ = ["OffloadSchedulePass", "ScheduleResult", "CostModel"]

SELECT = scorers.head_select  # step functions the pass calls directly
SPARSE = torch.ops.specontext.sparse_attention
KV_WRITE = torch.ops.specontext.kv_write
PLAN = torch.ops.specontext.offload_plan
PREFETCH = torch.ops.specontext.offload_prefetch.default
REFINE = aten_step.refine_selection

@dataclasses.dataclass
class CostModel:
    """Seconds per layer of an elastic load and of a layer's compute.

    Attributes:
        bandwidth: copy bandwidth, bytes/s (``runtime/calibration.py``).
        layer_bytes: estimated weight bytes read per decoder layer (compute estimate).
        load_bytes: expected bytes of one layer's elastic load per step.
        copy_latency: fixed cost of starting one copy job (s).
    """

    bandwidth: float
    layer_bytes: float
    load_bytes: float
    copy_latency: float = 50e-6

    @property
    def copy_s(self) -> float:
        return self.copy_latency + self.load_bytes / self.bandwidth

    @property
    def compute_s(self) -> float:
        return max(self.layer_bytes / self.bandwidth, 1e-6)

    def lead(self, max_inflight: int) -> int:
        """Layers ahead a prefetch is issued: ``ceil(copy / compute)``, in ``[1, max_inflight]``."""
        return max(1, min(max_inflight, math.ceil(self.copy_s / self.compute_s)))


@dataclasses.dataclass
class ScheduleResult:
    """What the pass did: per layer, where its prefetch was issued."""

    layers: list[int] = dataclasses.field(default_factory=list)
    issue_before: dict[int, str] = dataclasses.field(default_factory=dict)
    lead: int = 0
    cost: CostModel | None = None

    def describe(self) -> str:
        if not self.layers:
            return "offload schedule: nothing to schedule"
        c = self.cost
        return (f"offload schedule: {len(self.layers)} layers, lead {self.lead} layer(s) "
                f"(copy ~{float(c.copy_s) * 1e6:.0f} us vs compute ~{float(c.compute_s) * 1e6:.0f} us per layer)")


def _has_sinks(node: fx.Node) -> bool:
    """Whether a node is the attention of a site with learned sink logits (the pass calls
    :func:`~..runtime.aten_step.sinks_attention`)."""
    return is_op(node, aten_step.sinks_attention)


def _hint(size) -> int:
    """A size as an int: its value, or a symbolic size's value in the traced example (the cost
    model's estimate only: no guard, no host state)."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) and size.node.hint is not None else int(size)


def _is_latent(node: fx.Node) -> bool:
    """Whether a node is the attention op of a multi-head latent attention site (its variant
    has ``nope_dim > 0``)."""
    return is_op(node, SPARSE) and op_arguments(node, SPARSE)["variant"].nope_dim > 0


def _val(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _refine_of(indices: fx.Node) -> fx.Node | None:
    """The ``refine_selection`` node whose kept positions ``indices`` are (``getitem 0``), or None."""
    if indices.op == "call_function" and indices.target is operator.getitem and indices.args[1] == 0:
        source = indices.args[0]
        if isinstance(source, fx.Node) and is_op(source, REFINE):
            return source
    return None


def _offload_refine(graph: fx.Graph, refine: fx.Node, rows: tuple, dag: nx.DiGraph) -> None:
    """Replace a site's ``refine_selection`` by a call of :func:`offload_step.refine` (same kept
    positions, read from the device buffer of an offloaded layer); its outputs keep their
    users (``getitem`` 0 / 1)."""
    a = op_arguments(refine, REFINE)
    if a["spec"].min_coverage or isinstance(a["key_cache"], tuple):  # MLA: (latent, rotary) key stores
        raise ValueError("offload schedule: the fidelity guard (min_coverage) and MLA layers are not built "
                         "with offloaded two-stage selection")
    with graph.inserting_before(refine):
        new = graph.call_function(offload_step.refine, (
            rows, a["query"], a["candidates"], a["length"], a["attn_mask"], a["pages"], a["spec"], a["variant"]))
    new.meta.update({k: v for k, v in refine.meta.items() if k in ("example_value", "val", "stack_trace")})
    refine.replace_all_uses_with(new)
    graph.erase_node(refine)
    for inp in new.all_input_nodes:
        dag.add_edge(inp, new)
    for user in new.users:
        dag.add_edge(new, user)


def _run_plan(plan: fx.Node) -> None:
    """Set ``run=True`` on the cache's ``offload_plan`` node (positional or keyword)."""
    run_at = [a.name for a in PLAN.default._schema.arguments].index("run")
    if len(plan.args) > run_at:
        plan.args = (*plan.args[:run_at], True, *plan.args[run_at + 1:])
    else:
        plan.kwargs = {**plan.kwargs, "run": True}


class OffloadSchedulePass:
    """Callable FX pass (see the module docstring).

    Args:
        budget: tokens per KV head of the selection (the buffer rows).
        overlap: expected share of the selection reused from the previous step (0..1).
        max_inflight: most prefetches outstanding at once (the largest lead).
        bandwidth: copy bandwidth in bytes/s (``copy_bandwidth`` option or
            :func:`~specontext_compile.runtime.calibration.copy_bandwidth`).

    Raises:
        ValueError: a bandwidth that is not a positive finite number.
    """

    def __init__(self, budget: int, bandwidth: float, overlap: float = 0.8, max_inflight: int = 4):
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not 0 < bandwidth < math.inf:
            raise ValueError(f"offload schedule: bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
        self.budget, self.overlap, self.max_inflight, self.bandwidth = budget, overlap, max_inflight, float(bandwidth)

    def uuid(self) -> str:
        """torch's hash of this file and the offload runtime's with the pass's options."""
        cfg = repr((self.budget, self.overlap, self.max_inflight, self.bandwidth))
        runtime = Path(__file__).resolve().parent.parent / "runtime"
        files = (__file__, *(str(runtime / f) for f in ("offload.py", "offload_ops.py", "offload_step.py",
                                                         "aten_step.py", "scorers.py")))
        return f"specontext-offload-schedule-{get_hash_for_files(files, cfg).hex()[:24]}"

    def _cost(self, graph: fx.Graph, sparse: list[fx.Node]) -> CostModel:
        key = _val(op_arguments(sparse[0], SPARSE)["key_cache"])
        bandwidth = self.bandwidth
        param_bytes = 0
        for node in graph.nodes:
            v = _val(node) if node.op in ("placeholder", "get_attr") else None
            if isinstance(v, torch.Tensor) and ("parameters" in node.name or "_buffers_" in node.name):
                param_bytes += v.numel() * v.element_size()
        load = 0.0
        if key is not None:
            b, h, _, d = (_hint(x) for x in key.shape)  # an estimate: a symbolic size at its traced value
            load = (1 - self.overlap) * self.budget * b * h * 2 * d * key.element_size()
        layer_bytes = param_bytes / len(sparse) if param_bytes else 1e5
        return CostModel(bandwidth=bandwidth, layer_bytes=layer_bytes, load_bytes=load)

    def __call__(self, graph: fx.Graph) -> ScheduleResult:
        result = ScheduleResult()
        selects = [n for n in graph.nodes if is_op(n, SELECT)]
        sparse = [n for n in graph.nodes if is_op(n, SPARSE) and op_arguments(n, SPARSE)["spec"].route == "offload"]
        if any(_has_sinks(n) for n in graph.nodes):
            logger.warning("specontext: KV offload is not built for attention with learned sink logits "
                           "(GPT-OSS): those layers stay resident on the device (exact)")
        if any(_is_latent(n) for n in graph.nodes):
            logger.warning("specontext: KV offload is not built for multi-head latent attention (MLA) layers: "
                           "they stay resident on the device (exact); their latent cache is already several "
                           "times smaller than per-head keys and values")
        if not selects or not sparse:
            return result
        plans = [n for n in graph.nodes if is_op(n, PLAN)]
        if len(plans) != 1:
            logger.warning("specontext: compiled with device_memory_bytes, but the cache has no offload manager "
                           "(found %d), so every layer stays resident. Use specontext_compile.compile(model, "
                           "device_memory_bytes=...) or runtime.offload.enable_offload(cache, model, ..., "
                           "resident_layers=<the dense_layers option>) before the first call", len(plans))
            return result
        plan = plans[0]
        manager = op_arguments(plan, PLAN)["manager"]
        _run_plan(plan)
        writes = {n.args[0]: n for n in graph.nodes if is_op(n, KV_WRITE)}
        write_order = {store: i for i, store in enumerate(writes)}  # decoder layer order
        stores = [op_arguments(node, SPARSE)["key_cache"] for node in sparse]  # kept: erased nodes lose their args
        layers = [write_order.get(store, pos) for pos, store in enumerate(stores)]
        if max(layers) >= op_arguments(plan, PLAN)["layers"]:
            raise RuntimeError(f"offload schedule: layer {max(layers)} has no index among the plan's outputs")
        with graph.inserting_after(plan):
            layer_of = {layer: graph.call_function(operator.getitem, (plan, layer)) for layer in reversed(layers)}
        order = {n: i for i, n in enumerate(graph.nodes)}
        cost = self._cost(graph, sparse)
        lead = cost.lead(self.max_inflight)
        result.cost, result.lead = cost, lead
        dag = nx.DiGraph()
        for n in graph.nodes:
            for inp in n.all_input_nodes:
                dag.add_edge(inp, n)
        for pos, (node, layer) in enumerate(zip(sparse, layers)):
            a = op_arguments(node, SPARSE)
            key_cache, value_cache, indices, site_len = a["key_cache"], a["value_cache"], a["indices"], a["length"]
            refine = _refine_of(indices)
            loaded = op_arguments(refine, REFINE)["candidates"] if refine is not None else indices  # what the step prefetches
            inputs = [layer_of[layer], loaded, site_len]
            earliest = max(order[i] for i in inputs)
            first_use = refine if refine is not None else node  # the first read of the layer's rows
            anchor_node = writes.get(stores[max(0, pos - lead)])
            if anchor_node is None or order[anchor_node] <= earliest or order[anchor_node] > order[first_use]:
                anchor_node = layer_of[layer].next  # right after the plan (and after every input)
                while order.get(anchor_node, -1) <= earliest and anchor_node is not first_use:
                    anchor_node = anchor_node.next
            with graph.inserting_before(anchor_node):
                ticket = graph.call_function(PREFETCH, (manager, loaded, site_len, layer_of[layer]))
            rows = (manager, ticket, key_cache, value_cache)
            if refine is not None:
                _offload_refine(graph, refine, rows, dag)
            with graph.inserting_before(node):
                new = graph.call_function(offload_step.attention, (
                    rows, a["query"], indices, site_len, a["attn_mask"], a["variant"]))
            new.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for inp in inputs:
                dag.add_edge(inp, ticket)
            for inp in new.all_input_nodes:
                dag.add_edge(inp, new)
            ticket.meta["specontext_schedule"] = {"layer": layer, "lead": lead, "issued_before": anchor_node.name}
            result.layers.append(layer)
            result.issue_before[layer] = anchor_node.name
        if not nx.is_directed_acyclic_graph(dag):
            raise RuntimeError("offload schedule: the dependency graph has a cycle")
        position = {n: i for i, n in enumerate(graph.nodes)}
        for u, v in dag.edges:  # the node order respects every dependency edge
            if u in position and v in position and position[u] >= position[v]:
                raise RuntimeError(f"offload schedule broke a dependency: {u.name} -> {v.name}")
        graph.lint()
        logger.info("specontext: %s", result.describe())
        return result
