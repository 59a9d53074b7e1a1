"""Add what a rewritten graph counted to its model's counters (``sc.path_counts(model)``).

The rewrite counts each decode step in the cache's own int64 counters (``stats``, names in
``runtime/protocol.STATS``): ``aten_step.count_step`` and the refinement's guard both add
to it on the device. A ``SpeContextCache`` made inside ``generate`` is gone when the user
asks what ran, so every graph that counts also adds its step's increments to the *model's*
counters (``runtime/static_state.model_stats``), a new graph input appended after the others::

    before = stats.clone()            # first, before any count of this step
    ...                               # the step: count_step, refinements (add to stats)
    model_stats.add_(stats - before)  # last, before the output

Two tiny int64 ops per step, fused by inductor; no host read.

Invariant: the graph computes what it computed before; only ``model_stats`` is new.
"""

from __future__ import annotations

import torch
from torch import fx

from ..runtime import aten_step
from .sites import is_op

__all__ = ["MODEL_STATS_INPUT", "add_model_counts"]

MODEL_STATS_INPUT = "specontext_model_stats"
_COUNT = aten_step.count_step


def add_model_counts(graph: fx.Graph) -> bool:
    """Add the model's counters as the graph's last input and the step's increments to them.

    Returns False (graph untouched) when the graph counts nothing (no ``count_step``: a
    prefill or a graph without a rewritten site)."""
    counts = [n for n in graph.nodes if is_op(n, _COUNT)]
    if not counts:
        return False
    stats = counts[0].args[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        model_stats = graph.placeholder(MODEL_STATS_INPUT)
    model_stats.meta["example_value"] = _val(stats)
    with graph.inserting_after(model_stats if stats.op == "placeholder" else stats):
        before = graph.call_method("clone", (stats,))
    with graph.inserting_before(graph.output_node()):
        delta = graph.call_function(torch.sub, (stats, before))
        graph.call_method("add_", (model_stats, delta))
    graph.lint()
    return True


def _val(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))
