"""Lowering: replace the ``specontext::`` op nodes of a rewritten graph by their aten bodies.

After :class:`~.sparse_rewrite.SparseAttentionPass`, a decode graph holds our custom ops
(opaque to every compiler: inductor would call each one back through the dispatcher, with
its Python body, once per layer per step). For ``inner="inductor"`` this pass swaps each
op node for a call of the op's own sync-free implementation in
:mod:`~specontext_compile.runtime.aten_step`; AOTAutograd then traces *through* it, so
inductor sees gathers, matmuls, softmax and top-k as aten ops and fuses them with the
step, and the KV writes become ``index_copy_`` on graph inputs (re-inplaced by inductor,
as for Hugging Face's ``StaticCache``). The anchors, no-ops that only carried state into
the graph for the rewrite, are removed.

Invariants:

- **Same code, same numbers.** A lowered node calls exactly the function the op's eager
  kernel calls (:mod:`..runtime.aten_step`), with the same arguments; only the Python
  dispatch around it (counters, the recall probe, the Triton path) is gone.
- **Same signature, new target.** An op and its aten body take the same arguments (options
  as a :class:`~..runtime.spec.StepSpec` and an :class:`~..runtime.spec.AttentionVariant`),
  so lowering changes a node's target and nothing else.
- **Only the ops.** The cache's marker ``kv_write`` (as ``aten_step.write_kv`` and, for a store
  with page bounds, ``page_bounds.update_after_write``, for a store with the selection's int8
  rows, ``key_mirror.write_rows``) and torch-path
  ``sparse_attention`` (the body its spec's route names, decided by the rewrite pass and never
  here: ``aten_step.sparse_attention``, ``mla.mla_sparse_attention`` at a site whose variant
  is multi-head latent attention's, or on CUDA graphs ``kernel_step.kernel_attention``, both
  layouts) are lowered. What the pass inserts as
  direct calls of step functions needs nothing: the selection nodes
  (``scorers.head_select``), the per-layer
  ``aten_step.refine_selection``, ``record_query``, ``record_hidden`` and the counters. The
  draft head's step (``draft_step``: a loaded module), offload ops (they move rows and run the
  plan: runtime state outside the graph, ordered by their declared effects) and
  ``sparse_attention`` routed to the generated kernel off CUDA (Triton's interpreter) stay ops. An offloaded site's arithmetic is already ordinary step
  code (:mod:`..runtime.offload_step`), so a graph with offload is lowered like any other.
- **Order is kept.** Nodes are replaced in place; mutations stay where the ops were.
- **One body per refined site.** A refinement whose kept tokens only one plain sparse
  attention reads (guard off, no learned sinks, no dense shortcut, no MLA) is lowered with
  that attention as one :func:`~..runtime.aten_step.refine_and_attend`: the same logits,
  computed once (``LowerResult.fused`` counts them; the eager op chain keeps two ops); an
  offloaded site's pair likewise as :func:`~..runtime.offload_step.refine_and_attend`.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import operator

import torch
from torch import fx

from ..runtime import aten_step, kernel_step, key_mirror, mla, offload_step, page_bounds
from ..runtime import ops as _ops  # noqa: F401  (registers the specontext:: ops)
from ..runtime.protocol import is_op, op_arguments
from ..runtime.spec import AttentionVariant
from ..runtime.torch_private import OpOverload, OpOverloadPacket

logger = logging.getLogger(__name__)

__all__ = ["LowerResult", "lower_to_aten"]

_OPS = torch.ops.specontext
_ANCHORS = (_OPS.retrieval_anchor, _OPS.draft_anchor)
_SPARSE = _OPS.sparse_attention


@dataclasses.dataclass
class LowerResult:
    """What :func:`lower_to_aten` did: counts of lowered / removed / kept op nodes by op name."""

    lowered: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    removed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> reason
    fused: int = 0  # (refine_selection, sparse_attention) pairs lowered as one refine_and_attend
    kernel: int = 0  # sparse attention sites lowered to the generated Triton kernel (CUDA)
    kernel_refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # CUDA: reason -> sites


def _packet(target):
    if isinstance(target, OpOverload):
        return target.overloadpacket
    return target if isinstance(target, OpOverloadPacket) else None


def _route(node: fx.Node) -> str:
    """The route the rewrite pass decided for a ``sparse_attention`` node (``StepSpec.route``)."""
    return op_arguments(node, _SPARSE)["spec"].route


_REFINE = aten_step.refine_selection
_REFINE_PARAMS = inspect.signature(_REFINE).parameters
_SPARSE_PARAMS = inspect.signature(aten_step.sparse_attention).parameters


def _bound(node: fx.Node, params) -> dict:
    bound = dict(zip(params, node.args))
    bound.update(node.kwargs)
    return {name: bound.get(name, p.default) for name, p in params.items()}


def _sole_refinement(kept, refine_target, reader: fx.Node) -> fx.Node | None:
    """The ``refine_target`` node whose kept tokens (its output 0) are ``kept`` and read by
    ``reader`` alone, else None."""
    if not (isinstance(kept, fx.Node) and kept.target is operator.getitem and kept.args[1] == 0
            and list(kept.users) == [reader]):
        return None
    refine = kept.args[0]
    ok = isinstance(refine, fx.Node) and is_op(refine, refine_target) and list(refine.users) == [kept]
    return refine if ok else None


def _replace_pair(graph: fx.Graph, refine: fx.Node, attend: fx.Node, target, args: tuple) -> None:
    """One ``target(*args)`` node at ``attend``'s place instead of ``refine``, its kept tokens
    and ``attend``."""
    kept = next(iter(refine.users))
    with graph.inserting_before(attend):
        node = graph.call_function(target, args)
    node.meta.update(attend.meta)
    attend.replace_all_uses_with(node)
    for old in (attend, kept, refine):
        graph.erase_node(old)


def _fusable(sparse: fx.Node) -> fx.Node | None:
    """The lowered refinement whose kept tokens are all that lowered sparse attention node
    ``sparse`` reads, when the pair can be one :func:`aten_step.refine_and_attend` (guard off,
    no learned sinks, no dense shortcut, no MLA); else None."""
    args = _bound(sparse, _SPARSE_PARAMS)
    if args["spec"].route not in ("gather", "offload"):  # (guarded and learned-sink sites are not sparse_attention nodes)
        return None
    refine = _sole_refinement(args["indices"], _REFINE, sparse)
    if refine is None:
        return None
    mine = _bound(refine, _REFINE_PARAMS)
    same = all(mine[name] is args[name] or mine[name] == args[name] and not isinstance(mine[name], fx.Node)
               for name in ("query", "key_cache", "length", "attn_mask", "variant"))
    mla = isinstance(mine["key_cache"], tuple)  # MLA's (latent, rotary) key stores
    return refine if same and not mla and not mine["spec"].min_coverage else None


def _fuse_refine_attend(graph: fx.Graph) -> int:
    """Replace each fusable (refinement, sparse attention) pair by one
    :func:`aten_step.refine_and_attend` node at the attention's place; returns how many."""
    fused = 0
    for sparse in [n for n in graph.nodes if n.target is aten_step.sparse_attention]:
        refine = _fusable(sparse)
        if refine is None:
            continue
        mine, args = _bound(refine, _REFINE_PARAMS), _bound(sparse, _SPARSE_PARAMS)
        _replace_pair(graph, refine, sparse, aten_step.refine_and_attend, (
            mine["query"], (mine["key_cache"], args["value_cache"]), mine["candidates"], mine["length"],
            mine["attn_mask"], mine["spec"], mine["variant"], mine["pages"]))
        fused += 1
    return fused


_OFFLOAD_REFINE_PARAMS = inspect.signature(offload_step.refine).parameters
_OFFLOAD_ATTEND_PARAMS = inspect.signature(offload_step.attention).parameters


def _fuse_offloaded(graph: fx.Graph) -> int:
    """Replace each :func:`offload_step.refine` whose kept tokens only one
    :func:`offload_step.attention` of the same layer reads by one
    :func:`offload_step.refine_and_attend` at the attention's place; returns how many."""
    fused = 0
    for attend in [n for n in graph.nodes if n.target is offload_step.attention]:
        args = _bound(attend, _OFFLOAD_ATTEND_PARAMS)
        refine = _sole_refinement(args["indices"], offload_step.refine, attend)
        if refine is None:
            continue
        mine = _bound(refine, _OFFLOAD_REFINE_PARAMS)
        if any(mine[name] is not args[name] for name in ("query", "length", "attn_mask")) \
                or mine["rows"] != args["rows"] or mine["variant"] != args["variant"]:
            continue
        _replace_pair(graph, refine, attend, offload_step.refine_and_attend, (
            mine["rows"], mine["query"], mine["candidates"], mine["length"], mine["attn_mask"], mine["pages"],
            mine["spec"], mine["variant"]))
        fused += 1
    return fused


def _lower_write(graph: fx.Graph, node: fx.Node, check: bool) -> None:
    """``kv_write`` as ``aten_step.write_kv`` (after ``check_capacity`` when ``check``, its zero
    added to the positions), then, for a store with page bounds, ``update_after_write``, and for a
    store with the selection's int8 keys, ``key_mirror.write_rows``."""
    args = op_arguments(node, _OPS.kv_write)
    checked = ()
    if check:
        with graph.inserting_before(node):
            checked = (graph.call_function(_OPS.check_capacity.default,
                                           (args["length"], args["key_cache"], args["key"])),)
    node.target = aten_step.write_kv
    node.args, node.kwargs = (args["key_cache"], args["value_cache"], args["length"], args["key"],
                              args["value"], *checked), {}
    if args["page_bounds"]:
        with graph.inserting_after(node):
            graph.call_function(page_bounds.update_after_write, (
                args["key_cache"], list(args["page_bounds"]), args["length"], args["key"], args["page_tokens"],
                args["page_shift"]))
    if args.get("key_mirror"):
        with graph.inserting_after(node):
            graph.call_function(key_mirror.write_rows, (args["key_cache"], list(args["key_mirror"]), args["length"],
                                                        args["key"],
                                                        *checked))


def _gather_spec(node: fx.Node) -> None:
    """Send a ``sparse_attention`` node the pass routed to the kernel to the gather path
    instead (its spec's route set to ``"gather"``): the lowering's only change of a route,
    when the caller asks for no kernel (inductor could not compile it: the backend's
    fallback)."""
    args = op_arguments(node, _SPARSE)
    spec = dataclasses.replace(args["spec"], route="gather")
    node.args = tuple(spec if a is args["spec"] else a for a in node.args)
    node.kwargs = {k: spec if v is args["spec"] else v for k, v in node.kwargs.items()}


def _lower_attention(node: fx.Node, name: str, kernel_device: bool, no_kernel: bool, result: LowerResult) -> None:
    """A ``sparse_attention`` node to the body its route names (``StepSpec.route``):
    ``"dense"`` and ``"gather"`` to their aten body; ``"kernel"`` on a kernel device (CUDA
    graphs) to :func:`~..runtime.kernel_step.kernel_attention` (both layouts: the generated
    kernel or the generated MLA kernel), elsewhere it stays the op, and with ``no_kernel`` (the backend's fallback when
    inductor could not compile the kernel) it goes to the gather path, its route with it."""
    args = op_arguments(node, _SPARSE)
    latent = args["variant"].nope_dim > 0  # an MLA site
    if args["spec"].route == "kernel" and no_kernel:
        _gather_spec(node)
        result.kernel_refused["no kernel in this lowering (inductor could not compile it)"] += 1
    elif args["spec"].route == "kernel" and kernel_device:
        node.target = kernel_step.kernel_attention
        result.lowered[name] += 1
        result.kernel += 1
        return
    elif args["spec"].route == "kernel":
        result.kept[name] = "the generated kernel off CUDA (Triton's interpreter) is called as an op"
        return
    node.target = mla.mla_sparse_attention if latent else aten_step.sparse_attention
    result.lowered[name] += 1


def _value(arg):
    """A node's example value (dynamo's graphs keep it as ``example_value``, AOT's as ``val``),
    or the argument itself when it is a constant."""
    if not isinstance(arg, fx.Node):
        return arg
    return arg.meta.get("val", arg.meta.get("example_value"))


def _fused_products(graph: fx.Graph) -> None:
    """Every :class:`~..runtime.spec.AttentionVariant` argument of the graph's calls with
    ``fused_products`` on: the graph is for inductor, whose CPU code fuses a few decode rows'
    query-key products with the gathers that feed them (``sparse_attention.fused_products``).
    Data in the graph, read when AOTAutograd traces the step functions, where a trace-time
    module flag used to decide it."""
    def fused(arg):
        if isinstance(arg, AttentionVariant) and not arg.fused_products:
            return dataclasses.replace(arg, fused_products=True)
        return arg

    for node in graph.nodes:
        if node.op == "call_function":
            node.args = fx.node.map_aggregate(node.args, fused)
            node.kwargs = fx.node.map_aggregate(node.kwargs, fused)


def lower_to_aten(graph: fx.Graph, check_capacity: bool = False, fuse: bool = True,
                  kernel_device: bool = False, no_kernel: bool = False) -> LowerResult:
    """Replace lowerable ``specontext::`` op nodes of ``graph`` in place (see module docstring).

    ``fuse``: the graph is for inductor (the default): each fusable (refinement, attention)
    pair is lowered as one body, and every ``AttentionVariant`` argument gets
    ``fused_products`` (decode products as fused reductions on CPU); False keeps two calls, the refinement's and ``aten_step.sparse_attention`` (or
    an offloaded site's two), as ``inner="eager"`` runs them: the same kept set and logits,
    and each site's attention stays one Python call a caller can observe (a wrapper of
    ``aten_step.sparse_attention`` set before the graph is compiled).

    ``kernel_device`` (CUDA graphs): each sparse attention site the pass routed to the
    generated Triton kernel (``StepSpec.route == "kernel"``; why others were not: the pass's
    ``RewriteResult.route_reasons``) calls :func:`~..runtime.kernel_step.kernel_attention`
    (``LowerResult.kernel``); off a kernel device they stay the op. ``no_kernel`` (the
    backend's fallback when inductor could not compile the kernel) sends them to the gather
    path instead (``LowerResult.kernel_refused``).

    ``check_capacity`` (CPU graphs): ``specontext::check_capacity`` (an op: it reads the
    length on the host) goes before the first ``kv_write`` (layer 0) and its zero result is
    added to that write's positions, so it raises ``CacheCapacityError`` before the step
    writes any KV store; every later write depends on layer 0's store through the attention
    (the path counters and the retrieval state may already have advanced for that step).
    (Lowered writes past the store's end would stop the process in the compiled kernel's
    bounds check.)

    Returns:
        :class:`LowerResult` with per-op counts and the reason for each op kind kept.
    """
    result = LowerResult()
    nodes = [n for n in graph.nodes if n.op == "call_function"
             and getattr(_packet(n.target), "_qualified_op_name", "").startswith("specontext::")]
    names = {_packet(n.target)._qualified_op_name for n in nodes}
    if any(name.startswith("specontext::offload") for name in names):
        result.kept["specontext::offload_*"] = "they move KV rows and run the plan (runtime state outside the graph)"
    first_write = next((n for n in nodes if _packet(n.target) is _OPS.kv_write), None)
    for node in nodes:
        packet = _packet(node.target)
        name = packet._qualified_op_name
        if packet is _OPS.kv_write:
            _lower_write(graph, node, check_capacity and node is first_write)
            result.lowered[name] += 1
            if check_capacity and node is first_write:
                result.kept["specontext::check_capacity"] = "reads the length on the host (CPU), once per step"
        elif packet is _OPS.offload_plan and not op_arguments(node, packet)["run"] and not node.users:
            graph.erase_node(node)  # the cache's marker in a graph the schedule did not turn on
            result.removed[name] += 1
        elif name.startswith("specontext::offload"):
            continue  # kept (reason above)
        elif packet in _ANCHORS:
            graph.erase_node(node)
            result.removed[name] += 1
        elif packet is _SPARSE:
            _lower_attention(node, name, kernel_device, no_kernel, result)
        else:
            result.kept[name] = "no aten body (draft-head module or runtime state outside the graph)"
    result.fused = _fuse_refine_attend(graph) + _fuse_offloaded(graph) if fuse else 0
    if fuse:
        _fused_products(graph)
    graph.lint()
    for name, reason in result.kept.items():
        logger.info("specontext: %s stays an op: %s", name, reason)
    if result.kernel or result.kernel_refused:
        logger.info("specontext: %d sparse attention site(s) call the generated Triton kernel; torch body for %s",
                    result.kernel, dict(result.kernel_refused) or "none")
    return result
