"""Weight reads at the copy rate: one-row linear layers as a fused multiply-and-sum.

A decode step of batch 1 multiplies one activation row by every weight matrix: a
matrix-vector product whose cost is reading the weights. On CPU, ``aten::mm`` of a
``[1, k]`` row (MKL's GEMM path) reads the weights well below the copy rate, inductor's own
vectorised reduction of ``(w * x).sum(-1)`` near it (the figures and their command,
``python -m benchmarks.linear_bandwidth``, are in docs/benchmarks.md). This pass rewrites every
``linear`` whose input has exactly one row (all leading dimensions multiply to 1, known
from the traced shapes) into that form, so inductor emits one fused reduction kernel per
layer: same math, only the summation order differs (fp32 rounding).

Invariants:

- **Only provable one-row calls.** The leading dimensions of the input must be static and
  multiply to 1, the weight 2-D; anything else (prefill, batch > 1, symbolic shapes) is
  left to ``mm``, which reads the weights once for all rows.
- **CPU only.** The backend runs it for CPU graphs compiled with inductor (option
  ``gemv``); on CUDA, cuBLAS' GEMV is already at the bandwidth.
- **bfloat16 through our kernel where it is faster.** Inductor's reduction reads bfloat16
  weights at about 11 GB/s here; a one-row bfloat16 ``linear`` goes to
  ``specontext::cpu_gemv_bf16`` (``runtime/cpu_gemv.py``: AVX512_BF16's ``vdpbf16ps``)
  where :func:`~..runtime.cpu_gemv.applies` says so (decided here, from the traced values);
  the bias-free ones of one input row (query, key and value; gate and up) share one call.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..runtime import cpu_gemv
from ..runtime.torch_private import C_LINEAR

__all__ = ["one_row_linear", "rewrite_one_row_linears"]

_LINEAR = (C_LINEAR, torch.nn.functional.linear)


def one_row_linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 (linear's names)
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(input, weight, bias)`` for ``input`` ``[..., in_features]`` with one row, as
    ``(weight * input).sum(-1)``: ``weight`` ``[out_features, in_features]``; returns
    ``[..., out_features]`` in ``input``'s dtype."""
    out = (input.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


def _shape(node) -> tuple | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(val, torch.Tensor):
        return None
    if not all(type(s) is int for s in val.shape):  # symbolic (SymInt): never specialise it
        return None
    return tuple(val.shape)


def rewrite_one_row_linears(graph: fx.Graph) -> int:
    """Rewrite the one-row ``linear`` calls of ``graph`` in place; returns how many."""
    count = 0
    kernel: dict[fx.Node, list[fx.Node]] = {}  # input row -> its bias-free linears on our kernel
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        x = node.args[0] if node.args else node.kwargs.get("input")
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        xs, ws = _shape(x), _shape(w)
        if xs is None or ws is None or len(ws) != 2 or not xs or math.prod(xs[:-1]) != 1:
            continue
        node.target = cpu_gemv.one_row_linear if cpu_gemv.applies(_value(x), _value(w)) else one_row_linear
        if node.target is cpu_gemv.one_row_linear and _bias(node) is None:
            kernel.setdefault(x, []).append(node)
        count += 1
    order = {n: i for i, n in enumerate(graph.nodes)}
    for x, nodes in kernel.items():
        _share_row(graph, x, nodes, order)
    return count


def _bias(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _weight(node: fx.Node) -> fx.Node:
    return node.args[1] if len(node.args) > 1 else node.kwargs["weight"]


def _share_row(graph: fx.Graph, x: fx.Node, nodes: list[fx.Node], order: dict) -> None:
    """The linears of one input row on our kernel (a layer's query, key and value projections;
    its gate and up projections) as one call of it (:func:`~..runtime.cpu_gemv.one_row_linears`):
    one dispatch and one parallel region instead of one each. Only when every weight is defined
    before the first of them (the call takes the first one's place)."""
    first = nodes[0]
    if len(nodes) < 2 or any(order[_weight(n)] > order[first] for n in nodes if isinstance(_weight(n), fx.Node)):
        return
    with graph.inserting_before(first):
        shared = graph.call_function(cpu_gemv.one_row_linears, (x, tuple(_weight(n) for n in nodes)))
        shared.meta.update({k: v for k, v in first.meta.items() if k not in ("example_value", "val")})  # its layer
        shared.meta["example_value"] = tuple(_value(n) for n in nodes)
        items = [graph.call_function(operator.getitem, (shared, i)) for i in range(len(nodes))]
    for node, item in zip(nodes, items):
        item.meta.update(node.meta)
        node.replace_all_uses_with(item)
        graph.erase_node(node)


def _value(node: fx.Node) -> torch.Tensor:
    return node.meta.get("example_value", node.meta.get("val"))
