"""Weight freezing that takes effect: parameters folded into the graph before inductor sees it.

Inductor's ``freezing`` turns a graph's parameters into constants (so that, on CPU, oneDNN
packs the weights of linear layers and ``max_autotune`` may pick inductor's CPP GEMM template
for them) only when they reach it as attributes of the graph module. Dynamo makes them
attributes only when ``torch._inductor.config.freezing`` is already set while it traces (the
global flag, before any backend runs); otherwise every parameter arrives as a graph input and
inductor's freezing changes nothing. A backend's per-graph ``freezing`` patch is too late for
that, which is why option ``freezing`` used to be a no-op in the decode graph (issue 51,
docs/benchmarks.md, "Freezing that takes effect").

:func:`fold_parameters` does what dynamo would have done: each ``nn.Parameter`` input becomes
a ``get_attr`` of the same tensor (no copy), and :func:`drop_folded` gives the compiled graph
only the inputs it still takes. Invariants:

- **Only ``nn.Parameter`` inputs are folded.** Buffers, the KV stores and every input our
  passes added stay inputs (they change between steps). A folded parameter keeps the source
  dynamo gave its input (``gm._param_name_to_source``, which AOTAutograd reads for every
  parameter of a dynamo graph); one without a source is not folded.
- **Frozen means frozen.** A weight changed after the first compile is not seen by the
  compiled step (inductor's freezing contract); recompile (``torch._dynamo.reset()``) after
  changing weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["drop_folded", "fold_parameters"]


def fold_parameters(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[list[Any], list[int]]:
    """Make every ``nn.Parameter`` input of ``gm`` an attribute (``get_attr``) of the same tensor.

    Args:
        gm: a graph whose placeholders match ``example_inputs`` one to one (edited in place).
        example_inputs: the graph's inputs, real tensors (what dynamo hands a backend).

    Returns:
        ``(inputs, keep)``: the inputs left, and their positions in ``example_inputs`` (for
        :func:`drop_folded`).

    Raises:
        ValueError: when the placeholders and ``example_inputs`` differ in number.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        raise ValueError(f"fold_parameters: the graph has {len(placeholders)} inputs but {len(example_inputs)} "
                         "example inputs were given")
    sources = getattr(gm, "_param_name_to_source", None)  # dynamo's: AOTAutograd reads a source per parameter
    keep, folded = [], []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node, "_dynamo_source", None)
        if isinstance(value, torch.nn.Parameter) and node.users and (sources is None or source is not None):
            folded.append((node, value))
        else:
            keep.append(i)
    if folded:
        with gm.graph.inserting_after(placeholders[-1]):
            for index, (node, value) in enumerate(folded):
                name = f"_specontext_frozen_{index}"
                gm.register_parameter(name, value)
                if sources is not None:
                    sources[name] = node._dynamo_source
                attr = gm.graph.get_attr(name)
                attr.meta.update(node.meta)
                node.replace_all_uses_with(attr)
        for node, _ in folded:
            gm.graph.erase_node(node)
        gm.recompile()
    logger.debug("specontext: %d parameters folded into the graph for freezing", len(folded))
    return [example_inputs[i] for i in keep], keep


def drop_folded(compiled: Callable, keep: list[int]) -> Callable:
    """``compiled`` (a graph's compiled callable after :func:`fold_parameters`) called with the
    graph's original inputs: those at the positions ``keep`` are passed on, the folded ones
    dropped."""

    def call(*args):
        return compiled(*[args[i] for i in keep])

    return call
