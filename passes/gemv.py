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
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..runtime import cpu_kernels
from ..runtime.torch_private import C_LINEAR

__all__ = ["kernel_one_row_linears", "one_row_linear", "rewrite_one_row_linears"]

_LINEAR = (C_LINEAR, torch.nn.functional.linear)


def one_row_linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 (linear's names)
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(input, weight, bias)`` for ``input`` ``[..., in_features]`` with one row, as
    ``(weight * input).sum(-1)``: ``weight`` ``[out_features, in_features]``; returns
    ``[..., out_features]`` in ``input``'s dtype."""
    out = (input.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


def kernel_one_row_linears(input: torch.Tensor, weights: list[torch.Tensor],  # noqa: A002
                           biases: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(input, w, b) for w, b in zip(weights, biases))`` for one bfloat16 row, in one
    call of our CPU kernel (``runtime/cpu_kernels.cpu_one_row_linear``: float32 sums): each
    bias added in float32 and each result rounded once to ``input``'s dtype, as ``aten::linear``
    does. ``weights``: ``[out_features_k, in_features]``; returns ``[..., out_features_k]`` each."""
    products = torch.ops.specontext.cpu_one_row_linear(input, list(weights))
    outs, start = [], 0
    for weight, bias in zip(weights, biases):
        out = products[..., start:start + weight.shape[0]]
        start += weight.shape[0]
        outs.append((out if bias is None else out + bias.float()).to(input.dtype))
    return tuple(outs)


def _value(node) -> torch.Tensor | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shape(node) -> tuple | None:
    val = _value(node)
    if val is None:
        return None
    if not all(type(s) is int for s in val.shape):  # symbolic (SymInt): never specialise it
        return None
    return tuple(val.shape)


def _one_row(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(input, weight, bias)`` of a ``linear`` node whose input has one row (static shapes), else None."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    x = node.args[0] if node.args else node.kwargs.get("input")
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    xs, ws = _shape(x), _shape(w)
    if xs is None or ws is None or len(ws) != 2 or not xs or math.prod(xs[:-1]) != 1:
        return None
    return x, w, b


def rewrite_one_row_linears(graph: fx.Graph) -> tuple[int, int]:
    """Rewrite the one-row ``linear`` calls of ``graph`` in place: where our CPU kernel serves
    them (``cpu_kernels.linear_applies``), the calls that read the same input row become one
    :func:`kernel_one_row_linears` call (a layer's query/key/value, gate/up); the others become
    :func:`one_row_linear`. Returns how many linear calls went each way ``(fused, kernel)``."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[tuple[fx.Node, fx.Node, fx.Node | None]]] = {}
    fused = 0
    for node in list(graph.nodes):
        parts = _one_row(node)
        if parts is None:
            continue
        x, w, b = parts
        if cpu_kernels.linear_applies(_value(x), _value(w)) and (b is None or isinstance(b, fx.Node)):
            groups.setdefault(x, []).append((node, w, b))
        else:
            node.target = one_row_linear
            fused += 1
    kernel = 0
    for x, members in groups.items():
        for chunk in _defined_before_first(members, order):
            first = chunk[0][0]
            with graph.inserting_before(first):
                call = graph.call_function(kernel_one_row_linears,
                                           (x, [w for _, w, _ in chunk], [b for _, _, b in chunk]))
                call.meta.update(first.meta)  # stack trace and module path of the first linear
            for i, (node, _, _) in enumerate(chunk):
                with graph.inserting_before(node):
                    item = graph.call_function(operator.getitem, (call, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
                graph.erase_node(node)
            kernel += len(chunk)
    return fused, kernel


def _defined_before_first(members, order) -> list[list]:
    """``members`` (in graph order) split into runs whose weights and biases all exist before
    the run's first call: one kernel call is inserted there and must see every operand."""
    runs: list[list] = []
    for member in members:
        node, w, b = member
        operands = [w] + ([b] if isinstance(b, fx.Node) else [])
        if runs and all(order[op] < order[runs[-1][0][0]] for op in operands):
            runs[-1].append(member)
        else:
            runs.append([member])
    return runs
