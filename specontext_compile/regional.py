"""Regional compilation: inductor compiles each distinct decoder layer once.

Dynamo traces a decoder's layers into one flat graph, and inductor's scheduler (fusion,
dependency and peak-memory analysis) works over all of it: the decode graph of 30-layer SmolLM2 spends most of its first-step compile there, while the
C++ kernels of identical layers are already shared by their source (docs/benchmarks.md,
"Compile time"). This module splits a graph at decoder-layer boundaries
(``torch.fx.passes.split_module``; a node's layer is the outermost indexed module in dynamo's
``nn_module_stack``, e.g. ``model.layers[3]``), gives each region a structural key (its
nodes' ops, targets and constants; its inputs' shapes, strides and dtypes), and replaces
each region by a call of torch's ``invoke_subgraph`` higher-order op on its key's subgraph.
Inductor compiles the stitched graph once: each distinct subgraph once, as a function its
generated code calls for every layer of the key, so a step is one compiled call. Where
``invoke_subgraph`` cannot take the graph (:func:`subgraph_reason`: gradients enabled, an
opaque op of ours that writes an argument), each distinct region is compiled on its own and
a Python stitching module calls them (about 180 us a region call outside compiled code,
docs/benchmarks.md).

Invariants:

- **Same computation, same order.** Every node lands in exactly one region; a region is a
  contiguous run of the graph's node order (nodes the rewrite inserted, which carry no
  module, join the layer before them; nodes before the first layer form the prologue,
  after the last the epilogue), and regions run in that order, so in-place writes (KV
  store, page bounds, lagged queries, counters) keep their order.
- **Reuse only for the same program.** Equal keys mean the same ops and constants on inputs
  of the same shapes, strides and dtypes; inductor's size/stride asserts check every call.
- **Whole otherwise.** A graph with ``get_attr`` constants, a node whose fake value cannot be
  derived, or fewer than two decoder layers is compiled whole, with the reason at DEBUG; the
  caller decides freezing (weights must stay inputs for a region to be shared, so regional
  graphs are not frozen).
- **Symbolic shapes** (a graph dynamo recompiled with dynamic sizes) are split the same way;
  layers whose inputs carry different size symbols do not share a key (correct, compiled
  more than once).
- **Layer constants lifted.** An int argument that differs by layer (the lagged query's slot
  in ``record_query``) becomes a 0-d tensor made in the prologue
  (:func:`lift_layer_constants`), so the retrieval layers share one region.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .runtime.protocol import overloads
from .runtime.spec import AttentionVariant, StepSpec
from .runtime.torch_private import counters

logger = logging.getLogger(__name__)

__all__ = ["compile_regions", "lift_layer_constants", "region_labels", "stitch_subgraphs", "structure_key",
           "subgraph_reason"]

_ROOT = re.compile(r"^L\['[^']*'\](?:\[\d+\])*")  # dynamo's source of the root, e.g. L['args'][0]
_INDEXED = re.compile(r"(?:\[(\d+)\]|\.(\d+))(?=$|[.\[])")  # "[3]" or ".3", a whole index
PROLOGUE, EPILOGUE = "prologue", "epilogue"


def _layer_of(node: fx.Node) -> str | None:
    """The outermost indexed module (a ``ModuleList`` item such as ``model.layers[3]``) in the
    node's ``nn_module_stack``, or None."""
    for path, _type in (node.meta.get("nn_module_stack") or {}).values():
        path = path if isinstance(path, str) else str(path)
        root = _ROOT.match(path)
        match = _INDEXED.search(path, root.end() if root else 0)
        if match:
            return path[: match.end()]
    return None


def region_labels(graph: fx.Graph) -> dict[fx.Node, str]:
    """Each computing node's region: its layer's module path, ``"prologue"`` before the first
    layer node, ``"epilogue"`` after the last; any other node without a layer joins the region
    of the node before it. Placeholders and the output are not labelled."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    layers = [_layer_of(n) for n in nodes]
    last = max((i for i, layer in enumerate(layers) if layer is not None), default=-1)
    labels: dict[fx.Node, str] = {}
    current = PROLOGUE
    for i, (node, layer) in enumerate(zip(nodes, layers)):
        if i > last:
            current = EPILOGUE
        elif layer is not None:
            current = layer
        labels[node] = current
    return labels


def lift_layer_constants(graph: fx.Graph, lift: dict[Callable, int]) -> int:
    """Replace the int argument at position ``lift[target]`` of every call of ``target`` by a
    0-d int64 tensor of the same value made right after the graph's inputs (so in the
    prologue region), on the device of the call's first argument. The targets must accept
    either (e.g. ``aten_step.record_query``'s slot): a layer's slot constant would otherwise
    make every layer's region a distinct program. Returns how many arguments were lifted."""
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    lifted = 0
    for node in list(graph.nodes):
        position = lift.get(node.target) if node.op == "call_function" else None
        if position is None or type(node.args[position]) is not int:
            continue
        device = _val(node.args[0]).device
        with graph.inserting_after(last_input):
            value = graph.call_function(torch.full, ((), node.args[position]),
                                        {"dtype": torch.int64, "device": device})
        node.args = (*node.args[:position], value, *node.args[position + 1:])
        lifted += 1
    return lifted


def _val(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _describe(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(),
                str(value.dtype), str(value.device))
    return ("value", type(value).__name__, repr(value))


def _constant(arg: Any) -> Any:
    if isinstance(arg, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return repr(arg)
    if isinstance(arg, torch.Tensor):  # a tensor constant in the args: never shared
        return ("tensor-id", id(arg))
    return repr(arg)


def structure_rows(module: fx.GraphModule) -> list[tuple]:
    """A digest of ``module``'s program: per node its op, target and arguments (earlier nodes
    by position, constants by ``repr``), and for each input its shape, stride, storage offset,
    dtype and device (from the placeholder's example value). Names are left out, so two
    layers that differ only in names share a key."""
    position: dict[fx.Node, int] = {}
    rows = []
    for i, node in enumerate(module.graph.nodes):
        position[node] = i
        if node.op == "placeholder":
            rows.append(("in", _describe(_val(node))))
            continue
        target = node.target if isinstance(node.target, str) else (
            f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__qualname__', repr(node.target))}")
        args = fx.node.map_aggregate((node.args, node.kwargs),
                                     lambda a: ("%", position[a]) if isinstance(a, fx.Node) else _constant(a))
        rows.append((node.op, target, args))
    return rows


def structure_key(module: fx.GraphModule) -> str:
    """The sha256 of :func:`structure_rows`."""
    return hashlib.sha256(repr(structure_rows(module)).encode()).hexdigest()


def _fill_values(graph: fx.Graph) -> bool:
    """Give every node the rewrite inserted (no ``example_value``) a fake value by running its
    target on its inputs' fake values, in graph order; False when a node cannot be run so."""
    fake_mode = next((v.fake_mode for v in map(_val, graph.nodes) if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        return False
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or _val(node) is not None:
            continue
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: _val(a) if isinstance(a, fx.Node) else a)
        try:
            with fake_mode:
                target = getattr(args[0], node.target) if node.op == "call_method" else node.target
                value = target(*args[1:], **kwargs) if node.op == "call_method" else target(*args, **kwargs)
        except Exception:  # noqa: BLE001 (a node we cannot run on fakes: compile the graph whole)
            logger.debug("specontext: no fake value for %s", node.format_node(), exc_info=True)
            return False
        node.meta["val"] = value
    return True


def _symbols_bound(graph: fx.Graph) -> bool:
    """Whether every size symbol of a node's example value is bound by a node whose value is
    that symbol (a SymInt input or a computed size): ``split_module`` passes such nodes to the
    regions that need the symbol. Graphs where the backend added inputs with symbolic sizes
    (an adopted StaticCache's state) can miss them."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import free_symbols

    bound, used = set(), set()
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, (torch.SymInt, torch.SymFloat)) and isinstance(value.node.expr, sympy.Symbol):
            bound.add(value.node.expr)
        elif isinstance(value, torch.Tensor):
            used |= free_symbols(value)
    return used <= bound


def _whole_reason(gm: fx.GraphModule, labels: dict[fx.Node, str]) -> str | None:
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return "the graph holds get_attr constants"
    if not _fill_values(gm.graph):
        return "a node's value cannot be derived from fake inputs"
    if not _symbols_bound(gm.graph):
        return "a size symbol has no node that binds it (split_module needs one per symbol)"
    layers = {label for label in labels.values() if label not in (PROLOGUE, EPILOGUE)}
    if len(layers) < 2:
        return "fewer than two decoder layers"
    return None


def _unbound_symbol(region: fx.GraphModule) -> str | None:
    """Why inductor's code for ``region`` would name a size symbol no input of it binds, or
    None. Inductor binds a ``SymInt`` input's own symbol (:func:`placeholder_symbol`: before
    the shape environment's replacements, plus the symbols replaced *to* it) and the symbols of
    its tensor inputs' sizes and strides; a value computed inside the region may be sized by a
    symbol dynamo found equal to such an input's (``s84`` replaced by ``s40``), which only
    another region's inputs bind (seen on a second ``torch.compile`` of a model, whose sizes
    were already dynamic: ``NameError: name 's40' is not defined``)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    from .runtime.torch_private import placeholder_symbol

    bound, used, shape_env = set(), set(), None
    for node in region.graph.nodes:
        value = _val(node)
        if isinstance(value, torch.SymInt) and node.op == "placeholder":
            shape_env = value.node.shape_env
            bound.add(placeholder_symbol(value))
        elif isinstance(value, torch.Tensor) and node.op == "placeholder":
            bound |= free_symbols(value)
        if isinstance(value, (torch.Tensor, torch.SymInt)):
            used |= free_symbols(value)
    if shape_env is not None:  # inductor's aliases: a symbol replaced by a bound one is bound too
        bound |= {src for src, tgt in shape_env.replacements.items() if tgt in bound}
    missing = used - bound
    return f"a region uses size symbols its inputs do not bind: {sorted(map(str, missing))}" if missing else None


def compile_regions(gm: fx.GraphModule, compile_graph: Callable[[fx.GraphModule, list[Any]], Callable],
                    example_inputs: list[Any], lift: dict[Callable, int] | None = None) -> Callable | None:
    """Compile ``gm`` with each distinct region compiled once.

    The graph is split into regions (:func:`region_labels`). Where torch's ``invoke_subgraph``
    can take the graph (:func:`subgraph_reason`), each region becomes a call of that
    higher-order op on the subgraph of its :func:`structure_key`, and ``compile_graph`` (e.g.
    inductor's ``compile_fx`` with the caller's settings) compiles that stitched graph once:
    inductor compiles each distinct subgraph once, as a function its generated code calls per
    layer, so a step is one compiled call with no Python hop per region (issue 51, item 3);
    region inputs' mutations (KV store, page bounds, lagged queries) are kept by AOTAutograd's
    functionalization of the op (``auto_functionalized_v2``) and reinplaced by inductor (no
    copy of a store). Elsewhere each distinct region is compiled by ``compile_graph`` on its
    own and a Python stitching module (``split_module``'s) calls them in order (about 180 us
    a region call outside compiled code), with the reason at INFO.

    Args:
        gm: a graph dynamo traced (node metadata ``nn_module_stack`` and ``example_value``),
            rewritten and lowered by the backend; its node order is its execution order.
        compile_graph: compiles a ``GraphModule`` for example inputs.
        example_inputs: ``gm``'s example inputs as the backend received them (their aliasing
            is what AOTAutograd's duplicate and synthetic-base checks see at run time).
        lift: call targets whose int argument at the given position differs by layer (a
            slot): lifted to a tensor input by :func:`lift_layer_constants` (``gm`` is edited
            in place; the values are unchanged, so a graph compiled whole after all is too).

    Returns:
        A callable with ``gm``'s calling convention (positional inputs, ``gm``'s outputs), or
        None when the graph should be compiled whole (reason logged at DEBUG).

    Counters: ``counters["specontext"]["regions"]`` (regions run per call of the new graph),
    ``["regions_compiled"]`` (distinct regions compiled), ``["regions_as_subgraphs"]``
    (graphs stitched with ``invoke_subgraph``).
    """
    labels = region_labels(gm.graph)
    layers = {label for label in labels.values() if label not in (PROLOGUE, EPILOGUE)}
    if len(layers) >= 2 and lift:
        lift_layer_constants(gm.graph, lift)
        gm.recompile()
        labels = region_labels(gm.graph)
    reason = _whole_reason(gm, labels)
    if reason is not None:
        logger.debug("specontext: compiling the graph whole (%s)", reason)
        return None
    split = _split(gm, labels)
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    unbound = next((r for r in (_unbound_symbol(getattr(split, n.target)) for n in calls) if r), None)
    if unbound is not None:
        logger.debug("specontext: compiling the graph whole (%s)", unbound)
        return None
    keys = {node: structure_key(getattr(split, node.target)) for node in calls}
    counters["specontext"]["regions"] += len(calls)
    counters["specontext"]["regions_compiled"] += len(set(keys.values()))
    reason = subgraph_reason(gm) or _outputless_region(split, calls)
    if reason is None:
        stitch_subgraphs(split, keys)
        logger.info("specontext: regional compile: %d regions as calls of %d subgraphs in one graph",
                    len(calls), len(set(keys.values())))
        try:
            compiled = compile_graph(split, example_inputs)
        except Exception as err:  # noqa: BLE001 - only inductor's known refusal below is handled
            if "auto_functionalized" not in str(err):
                raise
            # torch 2.13: inductor's decomposition of a functionalized subgraph call can leave
            # it in place (DeepSeek-V2's layers): the regions are compiled one by one instead
            reason = f"inductor could not compile the stitched subgraphs ({str(err).splitlines()[0][:120]})"
            split = _split(gm, labels)
            keys = {node: structure_key(getattr(split, node.target))
                    for node in split.graph.nodes if node.op == "call_module"}
        else:
            counters["specontext"]["regions_as_subgraphs"] += 1
            return compiled
    logger.info("specontext: regional compile: %d regions, %d compiled one by one (%s)", len(calls),
                len(set(keys.values())), reason)
    return _compile_each(split, keys, compile_graph)


def subgraph_reason(gm: fx.GraphModule) -> str | None:
    """Why torch's ``invoke_subgraph`` (torch 2.13) cannot stitch ``gm``'s regions, or None:
    gradients are enabled (it refuses in-place input mutations under autograd), an input is a
    tensor subclass (tensor parallelism's ``DTensor``: it has no rule for them), or an op
    outside aten writes an argument (ours kept opaque: the draft head's ops, KV offload's,
    every op under ``lower=False``; its functionalization refuses such ops or lists), or an op
    kept opaque takes one of our option objects (``StepSpec``, ``AttentionVariant``: a
    ``sparse_attention`` site routed to the generated kernel under Triton's interpreter), which
    inductor's code for a stitched region names without importing (``NameError``)."""
    if torch.is_grad_enabled():
        return "gradients are enabled"
    for node in gm.graph.find_nodes(op="placeholder"):
        if hasattr(type(_val(node)), "__tensor_flatten__"):  # a tensor subclass, e.g. a DTensor under tensor parallelism
            return f"input {node.name} is a {type(_val(node)).__name__} (invoke_subgraph takes plain tensors)"
    for node in gm.graph.nodes:
        if node.op == "call_function" and _opaque_write(node):
            return f"{node.target} writes an argument"
        if node.op == "call_function" and _takes_spec(node):
            return f"{node.target} takes an option object (StepSpec / AttentionVariant)"
    return None


def _outputless_region(split: fx.GraphModule, calls: list[fx.Node]) -> str | None:
    """Why ``invoke_subgraph`` cannot call one of ``split``'s regions, or None: a region that
    returns nothing (only writes its inputs: BertGeneration's last region), which the op
    refuses ("hop is expected to return at least one output")."""
    for node in calls:
        output = next(n for n in reversed(getattr(split, node.target).graph.nodes) if n.op == "output")
        if output.args[0] is None or output.args[0] in ((), []):
            return f"region {node.target} returns nothing"
    return None


def _takes_spec(node: fx.Node) -> bool:
    """Whether ``node`` calls an op (an ``OpOverload``, kept opaque) with a ``StepSpec`` or an
    ``AttentionVariant`` among its arguments."""
    if not overloads(node.target):
        return False
    found = []
    fx.node.map_aggregate((node.args, node.kwargs),
                          lambda a: found.append(a) if isinstance(a, (StepSpec, AttentionVariant)) else a)
    return bool(found)


def _opaque_write(node: fx.Node) -> bool:
    """Whether ``node`` calls an op outside aten whose schema writes an argument."""
    return any(op.namespace != "aten" and any(a.is_write for a in op._schema.arguments)
               for op in overloads(node.target))


def _split(gm: fx.GraphModule, labels: dict[fx.Node, str]) -> fx.GraphModule:
    """``gm`` split at its labels' runs (``torch.fx.passes.split_module``, original order)."""
    from torch.fx.passes.split_module import split_module

    runs: dict[fx.Node, int] = {}  # a new partition at every change of label: contiguous runs
    run, previous = -1, None
    for node, label in labels.items():
        if label != previous:
            run, previous = run + 1, label
        runs[node] = run
    return split_module(gm, None, lambda n: runs[n], keep_original_order=True, keep_original_input_name=True)


def stitch_subgraphs(split: fx.GraphModule, keys: dict[fx.Node, str]) -> fx.GraphModule:
    """``split``'s region calls (``keys``: each call's :func:`structure_key`) replaced in place
    by ``invoke_subgraph(subgraph, name, *inputs)`` on one subgraph per key (its outputs made a
    tuple, as the op requires); returns ``split``."""
    names: dict[str, str] = {}
    for node, key in keys.items():
        region = getattr(split, node.target)
        single = _outputs_as_tuple(region)
        if key not in names:
            names[key] = f"region_{len(names)}"
            setattr(split, names[key], region)
        delattr(split, node.target)
        with split.graph.inserting_before(node):
            subgraph = split.graph.get_attr(names[key])
            call = split.graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                             (subgraph, names[key], *node.args))
        if single:
            with split.graph.inserting_after(call):
                call = split.graph.call_function(operator.getitem, (call, 0))
        node.replace_all_uses_with(call)
        split.graph.erase_node(node)
    split.graph.lint()
    split.recompile()
    return split


def _compile_each(split: fx.GraphModule, keys: dict[fx.Node, str],
                  compile_graph: Callable[[fx.GraphModule, list[Any]], Callable]) -> Callable:
    """Each distinct region of ``split`` compiled on its own (fresh fake inputs), every call
    of its key pointed at the compiled region; ``split``'s Python calls them in order."""
    compiled: dict[str, Callable] = {}
    for node, key in keys.items():
        region = getattr(split, node.target)
        if key not in compiled:
            inputs = _fresh_inputs([_val(p) for p in region.graph.nodes if p.op == "placeholder"])
            compiled[key] = compile_graph(region, inputs)
        delattr(split, node.target)
        setattr(split, node.target, compiled[key])
    split.recompile()
    return split.forward


def _fresh_inputs(values: list[Any]) -> list[Any]:
    """A region's example inputs with repeated objects replaced by fresh fakes of the same
    metadata: two inputs that are one tensor at compile time would be compiled as aliases."""
    seen: set[int] = set()
    out = []
    for value in values:
        if isinstance(value, torch.Tensor) and id(value) in seen:
            with value.fake_mode:
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                            device=value.device)
        seen.add(id(value))
        out.append(value)
    return out


def _outputs_as_tuple(region: fx.GraphModule) -> bool:
    """Make ``region`` return a tuple (``invoke_subgraph``'s calling convention); True when it
    returned one value, which the caller then takes as item 0."""
    output = next(n for n in reversed(region.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    region.recompile()
    return True
