"""Adopt Hugging Face's ``StaticCache`` as a KV store: the pass that runs before the rewrite.

A graph traced with ``StaticCache`` writes each layer's K/V as ``StaticLayer.update`` does
(transformers >= 5)::

    cache_position = torch.arange(q_len) + cumulative_length
    cumulative_length.add_(q_len)
    keys.index_copy_(2, cache_position, key_states)
    values.index_copy_(2, cache_position, value_states)

which is exactly ``specontext::kv_write(keys, values, cumulative_length, key_states,
value_states, [])``: write at ``length .. length+q_len-1``, then advance ``length`` by ``q_len``.
This pass replaces each such group by that op (the rewrite pass recognises a store by it),
and puts a ``specontext::retrieval_anchor`` before layer 0's write whose state tensors
(:class:`~specontext_compile.runtime.static_state.StaticCacheState`) are *new graph inputs*
appended after dynamo's: the backend passes them on every call. Nothing else changes, so
the graph still computes what Hugging Face's does, and the rewrite pass then makes it
sparse exactly as with ``SpeContextCache``.

Matched only when every piece is the one above: the index is ``arange(q_len) + L`` with the
same ``L`` that one ``L.add_(q_len)`` advances before the key write, the copy dimension is 2,
the key and value writes share that index, and nothing reads ``L`` between its advance and
the value write (where ``kv_write`` advances it). Anything else (a sliding-window layer's
rolling buffer, another cache's writes) is left as it is and its attention stays dense.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from ..runtime.static_state import StaticCacheState, bind_state, state_for
from .sites import ANCHOR, KV_WRITE, find_attention_sites, is_op, static_int

logger = logging.getLogger(__name__)

__all__ = ["AdoptedStaticCache", "adopt_static_cache", "has_static_cache_writes"]

STATE_INPUTS = ("specontext_query_state", "specontext_query_valid", "specontext_stats")


@dataclasses.dataclass
class AdoptedStaticCache:
    """What :func:`adopt_static_cache` did to one graph.

    ``writes``: K/V write groups turned into ``kv_write`` (one per layer); ``state``: the
    state the graph was compiled with (None when no anchor was added, e.g. no attention
    reads the stores); ``reason``: why no anchor was added, else None.

    The retrieval state is per *cache* (``runtime/static_state.py``): a call finds it from
    the first adopted key store it passes (input ``store_input``). A graph that creates that
    store itself (Hugging Face initialises a ``StaticCache`` lazily, in its first call) runs
    with a fresh state and binds it to the store it returns (output ``store_output``)."""

    writes: int = 0
    state: StaticCacheState | None = None
    reason: str | None = None
    store_input: int | None = None
    store_output: int | None = None
    shape: tuple | None = None  # (num_heads, head_dim, dtype, device): the same for every call
    batch: BatchReader | None = None  # the call's batch, read from its real inputs
    example_values: tuple = ()  # the state inputs' fake values (the graph's batch: maybe symbolic)

    def state_for_call(self, args) -> StaticCacheState:
        """The state of the cache this call writes (fresh when the call creates its stores),
        at this call's batch: a graph dynamo made batch-symbolic serves every batch size, so
        the batch is read from the call's real inputs, never from the traced shape."""
        if self.store_input is not None:
            store = args[self.store_input]
            return state_for(store, store.shape[0], *self.shape)
        return StaticCacheState.allocate(self.batch(args), *self.shape)

    def bind(self, outputs, state: StaticCacheState) -> None:
        """After a call that created the cache's stores: ``state`` becomes that cache's."""
        if self.store_input is None and self.store_output is not None:
            bind_state(outputs[self.store_output], state, state.query_state.shape[1], *self.shape)


@dataclasses.dataclass(frozen=True)
class BatchReader:
    """Where a call's batch size is: a constant (a static graph), input ``index`` itself (a
    size dynamo lifted as an int input) or dimension ``dim`` of tensor input ``index``."""

    constant: int | None = None
    index: int | None = None
    dim: int | None = None

    def __call__(self, args) -> int:
        if self.constant is not None:
            return self.constant
        value = args[self.index]
        return int(value.shape[self.dim] if self.dim is not None else value)

    @classmethod
    def of(cls, graph: fx.Graph, size) -> BatchReader | None:
        """The reader of ``size`` (an int, or a ``SymInt`` of the graph's shape environment)
        from the graph's inputs; None when no input carries it."""
        if static_int(size) is not None:
            return cls(constant=static_int(size))
        expr = size.node.expr
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        values = [p.meta.get("example_value", p.meta.get("val")) for p in placeholders]
        for i, value in enumerate(values):
            if isinstance(value, torch.SymInt) and value.node.expr == expr:
                return cls(index=i)
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                for d, dim in enumerate(value.shape):
                    if isinstance(dim, torch.SymInt) and dim.node.expr == expr:
                        return cls(index=i, dim=d)
        return None


def _is_index_copy(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "index_copy_"
    return node.op == "call_function" and node.target in (torch.Tensor.index_copy_,)


def _length_arg(value) -> int | fx.Node | None:
    """A token count: an int, or a node (a symbolic length under dynamic shapes)."""
    if isinstance(value, fx.Node) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return None


def _positions(index: fx.Node) -> tuple[fx.Node, int] | None:
    """``(L, q_len)`` when ``index`` is ``arange(q_len) + L`` (either operand order)."""
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target in (operator.add, torch.add)):
        return None
    if len(index.args) != 2 or index.kwargs.get("alpha", 1) != 1:
        return None
    for ar, length in (index.args, index.args[::-1]):
        if (isinstance(ar, fx.Node) and ar.op == "call_function" and ar.target is torch.arange
                and len(ar.args) == 1 and _length_arg(ar.args[0]) is not None and isinstance(length, fx.Node)):
            return length, ar.args[0]
    return None


def _advance(length: fx.Node, q_len: int | fx.Node) -> fx.Node | None:
    """The single ``length.add_(q_len)`` node (same int, or the same symbolic node)."""
    adds = [u for u in length.users if u.op == "call_method" and u.target == "add_" and u.args[0] is length
            and len(u.args) == 2 and _length_arg(u.args[1]) is not None and not u.kwargs
            and (u.args[1] is q_len if isinstance(q_len, fx.Node) else u.args[1] == q_len)]
    return adds[0] if len(adds) == 1 else None


def _write_groups(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """``(advance, key_write, value_write, length)`` for every StaticLayer update pattern."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    copies = [n for n in graph.nodes if _is_index_copy(n)]
    groups, used = [], set()
    for k_write in copies:
        if k_write in used or len(k_write.args) != 4 or k_write.kwargs or k_write.args[1] != 2:
            continue
        index = k_write.args[2]
        v_write = next((c for c in copies if c not in used and c is not k_write and order[c] > order[k_write]
                        and len(c.args) == 4 and c.args[1] == 2 and c.args[2] is index), None)
        found = _positions(index)
        if v_write is None or found is None:
            continue
        length, q_len = found
        advance = _advance(length, q_len)
        if advance is None or not (order[index] < order[advance] < order[k_write]):
            continue
        between = [u for u in length.users if order[advance] < order[u] <= order[v_write]]
        if between:
            continue
        used.update((k_write, v_write))
        groups.append((advance, k_write, v_write, length))
    return groups


def _replace(graph: fx.Graph, group) -> fx.Node:
    advance, k_write, v_write, length = group
    key_store, value_store = k_write.args[0], v_write.args[0]
    with graph.inserting_before(v_write):
        write = graph.call_function(KV_WRITE, (key_store, value_store, length, k_write.args[3], v_write.args[3], [],
                                               []))
    for meta in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if meta in k_write.meta:
            write.meta[meta] = k_write.meta[meta]
    write.meta["example_value"] = None
    for old, store in ((v_write, value_store), (k_write, key_store)):
        old.replace_all_uses_with(store)
        graph.erase_node(old)
    advance.replace_all_uses_with(length)
    graph.erase_node(advance)
    return write


def has_static_cache_writes(graph: fx.Graph) -> bool:
    """True when ``graph`` has no retrieval anchor and holds a ``StaticLayer`` write group."""
    return not any(is_op(n, ANCHOR) for n in graph.nodes) and bool(_write_groups(graph))


def _store_slots(graph: fx.Graph, store: fx.Node) -> tuple[int | None, int | None]:
    """``(input, output)``: the position of ``store`` among the graph's inputs (None when
    the graph creates it) and among its outputs (None when not returned)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if store in placeholders:
        return placeholders.index(store), None
    outputs = graph.output_node().args[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return None, (outputs.index(store) if store in outputs else None)


def _add_state_inputs(graph: fx.Graph, state: StaticCacheState, batch) -> list[fx.Node]:
    """The state's placeholders, after dynamo's. Their fake values carry the store's batch as
    the graph has it (``batch``: a ``SymInt`` when dynamo made it symbolic), so the graph
    compiles for every batch size its guards admit, as the stores do."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = next((n.meta["example_value"].fake_mode for n in placeholders
                      if hasattr(n.meta.get("example_value"), "fake_mode")), None)
    nodes, last = [], placeholders[-1]
    for name, tensor in zip(STATE_INPUTS, state.tensors()):
        with graph.inserting_after(last):
            last = graph.placeholder(name)
        if fake_mode is None:
            last.meta["example_value"] = tensor
        else:
            shape = list(tensor.shape)
            if tensor is state.query_state:
                shape[1] = batch
            with fake_mode:
                last.meta["example_value"] = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        nodes.append(last)
    return nodes


def adopt_static_cache(gm: fx.GraphModule, example_inputs: list) -> AdoptedStaticCache | None:
    """Turn ``StaticCache`` writes into ``kv_write`` and add the retrieval anchor (see the
    module docstring). Returns None when the graph holds no such write or already has an
    anchor (a ``SpeContextCache`` graph); the graph is then untouched.

    When ``result.state`` is set, the caller appends ``result.state_for_call(args).tensors()``
    to every call's inputs and calls ``result.bind(outputs, state)`` after it."""
    graph = gm.graph
    if any(is_op(n, ANCHOR) for n in graph.nodes):
        return None
    groups = _write_groups(graph)
    if not groups:
        return None
    writes = [_replace(graph, g) for g in groups]
    result = AdoptedStaticCache(writes=len(writes))
    sites = [s for s in find_attention_sites(graph) if s.num_heads and s.head_dim and s.query is not None]
    if not sites:
        result.reason = "no attention reads the adopted StaticCache stores"
        graph.lint()
        return result
    query = sites[0].query.meta.get("example_value", sites[0].query.meta.get("val"))
    store_node = writes[0].args[0]
    store = store_node.meta.get("example_value", store_node.meta.get("val"))
    result.store_input, result.store_output = _store_slots(graph, store_node)
    if result.store_input is None and result.store_output is None:
        result.reason = "the first adopted key store is neither a graph input nor an output (no cache to key on)"
        graph.lint()
        return result
    result.batch = BatchReader.of(graph, store.shape[0])
    if result.batch is None:
        result.reason = "the batch size is symbolic and no graph input carries it (no state to size)"
        graph.lint()
        return result
    result.shape = (sites[0].num_heads, sites[0].query_width, query.dtype, store.device)
    result.state = result.state_for_call(example_inputs)  # the real inputs: concrete sizes
    query_state, query_valid, stats = _add_state_inputs(graph, result.state, store.shape[0])
    result.example_values = tuple(n.meta["example_value"] for n in (query_state, query_valid, stats))
    with graph.inserting_before(writes[0]):
        anchor = graph.call_function(ANCHOR, (query_state, query_valid, stats, None, ""))
    anchor.meta["example_value"] = None
    graph.lint()
    logger.info("specontext: adopted %d StaticCache layer writes as KV stores", len(writes))
    return result

