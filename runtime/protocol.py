"""What the KV cache tells the pass through the traced graph: the anchors' typed arguments.

``SpeContextCache`` calls ``specontext::retrieval_anchor`` (and, with a draft head,
``specontext::draft_anchor``) at layer 0 so that its state tensors and constants enter the
traced graph; the rewrite pass reads them back from the anchor nodes. Both sides go through
the dataclasses here — never through positional indices — so a new field is added in one
place. Field names are the op schemas' argument names.

Meanings (one per name):

- ``layer_windows``: one comma-separated int per decoder layer: 0 = full causal attention,
  ``w > 0`` = a *sliding window* of ``w`` tokens (HF's ``sliding_window``), -1 = another
  attention kind the rewrite leaves dense. (The always-kept last tokens of a selection are
  the *recent window*, option ``recent_window``: a different thing.)
- ``stats``: int64 ``[len(STATS)]`` path counters kept by the compiled step itself (see
  :data:`STATS`), so a test can tell which path ran even when inductor compiled it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import fx

from .torch_private import OpOverload, OpOverloadPacket

__all__ = ["FALLBACK_STAT", "GUARD_STAT", "STATS", "DraftAnchor", "RetrievalAnchor", "is_op", "op_arguments", "overloads"]

# Counters a SpeContextCache keeps in ``stats`` (index = position), advanced once per decode
# step by ``aten_step.count_step`` (a direct call) with constants the pass computed from static shapes:
STATS = (
    "decode_steps",      # steps that ran a selection node (one per step, whatever the windows)
    "sparse_sites",      # attention calls over a selection (every rewritten site, every step)
    "gather_sites",      # ... of which gathered the selected rows
    "dense_store_sites",  # ... of which attended densely over the store (budget >= capacity)
    "guard_dense_sites",  # ... of which the fidelity guard ran dense (coverage < min_coverage)
    "page_rescue_sites",  # ... of which refined with the page rescue (option page_rescue)
    "recency_fallback_steps",  # decode steps whose selection ranked by recency: the head's state
                               # missed the context (no query recorded at this length, a draft
                               # key cache behind: a step ran without the backend, a crop, a reset)
)
GUARD_STAT = STATS.index("guard_dense_sites")
FALLBACK_STAT = STATS.index("recency_fallback_steps")


def is_op(node: fx.Node, target) -> bool:
    """True when ``node`` calls ``target``: an op packet (dynamo records packets, AOT records
    overloads) or a step function the pass calls directly (a wrapper of it made with
    ``functools.wraps``, e.g. a test's spy set before compiling, counts as the function)."""
    if node.op != "call_function":
        return False
    if isinstance(target, OpOverloadPacket):
        return node.target is target or getattr(node.target, "overloadpacket", None) is target
    return node.target is target or inspect.unwrap(node.target) is target


def overloads(target) -> list[OpOverload]:
    """The op overloads a call target may run: an overload itself, every overload of a packet
    (dynamo records packets), none for anything else (a function, a method name)."""
    if isinstance(target, OpOverloadPacket):
        return [getattr(target, name) for name in target.overloads()]
    return [target] if isinstance(target, OpOverload) else []


def op_arguments(node: fx.Node, target) -> dict[str, Any]:
    """The arguments of a call of ``target`` in ``node`` by name, defaults filled: an op packet
    (its schema's names) or a step function the pass calls directly (its parameters')."""
    if not isinstance(target, OpOverloadPacket):
        params = inspect.signature(target).parameters
        bound = dict(zip(params, node.args))
        bound.update(node.kwargs)
        return {name: bound[name] if name in bound else p.default for name, p in params.items()
                if name in bound or p.default is not inspect.Parameter.empty}
    schema = target.default._schema
    values: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            values[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    return values


@dataclasses.dataclass(frozen=True)
class RetrievalAnchor:
    """Arguments of ``specontext::retrieval_anchor``: the lagged-query state
    (``query_state`` ``[slots, batch, num_heads, 1, head_dim]``, ``query_valid`` int64
    ``[slots]``), the per-layer sliding windows (str, see the module docstring) and the
    path counters ``stats`` (int64 ``[len(STATS)]``). Values are tensors on the cache side
    and FX nodes on the pass side."""

    query_state: Any
    query_valid: Any
    layer_windows: str | None
    stats: Any
    selection_state: Any = None  # [batch, kv, capacity] int64: a step's selection for later graphs
    layer: int = 0  # index of the anchor's KV layer among the layers with a store

    def emit(self) -> None:
        """Call the anchor op (cache side)."""
        torch.ops.specontext.retrieval_anchor(self.query_state, self.query_valid, self.stats,
                                              self.selection_state, self.layer_windows, self.layer)

    @classmethod
    def of(cls, node: fx.Node) -> RetrievalAnchor:
        """Read an anchor node (pass side)."""
        args = op_arguments(node, torch.ops.specontext.retrieval_anchor)
        return cls(args["query_state"], args["query_valid"], args.get("layer_windows"), args["stats"],
                   args.get("selection_state"), args.get("layer", 0))

    @staticmethod
    def first(graph: fx.Graph) -> fx.Node | None:
        """The graph's first retrieval anchor (the cache emits one per KV layer), or None."""
        return next((n for n in graph.nodes if is_op(n, torch.ops.specontext.retrieval_anchor)), None)

    def windows(self) -> list[int] | None:
        """The per-layer sliding windows, or None when the cache sent none."""
        text = self.layer_windows
        return [int(w) for w in text.split(",")] if isinstance(text, str) and text else None


@dataclasses.dataclass(frozen=True)
class DraftAnchor:
    """Arguments of ``specontext::draft_anchor``: the draft head's key cache (``draft_keys``
    ``[batch, head_kv_heads, capacity, head_dim]``, ``draft_length`` int64 scalar), the
    recorded auxiliary hidden states (``aux_state`` ``[batch, 1 + ROLLBACK_TOKENS, aux_width]``,
    ``aux_valid`` int64 ``[1 + ROLLBACK_TOKENS]``) and ``head``, the head's resolved folder (str)."""

    draft_keys: Any
    draft_length: Any
    aux_state: Any
    aux_valid: Any
    head: str

    def emit(self) -> None:
        torch.ops.specontext.draft_anchor(self.draft_keys, self.draft_length, self.aux_state, self.aux_valid,
                                          self.head)

    @classmethod
    def of(cls, node: fx.Node) -> DraftAnchor:
        args = op_arguments(node, torch.ops.specontext.draft_anchor)
        return cls(args["draft_keys"], args["draft_length"], args["aux_state"], args["aux_valid"], args["head"])
