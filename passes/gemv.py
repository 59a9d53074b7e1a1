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
  where :func:`~..runtime.cpu_gemv.applies` says so (decided here, from the traced values).
"""

from __future__ import annotations

import math

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
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        x = node.args[0] if node.args else node.kwargs.get("input")
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        xs, ws = _shape(x), _shape(w)
        if xs is None or ws is None or len(ws) != 2 or not xs or math.prod(xs[:-1]) != 1:
            continue
        node.target = cpu_gemv.one_row_linear if cpu_gemv.applies(_value(x), _value(w)) else one_row_linear
        count += 1
    return count


def _value(node: fx.Node) -> torch.Tensor:
    return node.meta.get("example_value", node.meta.get("val"))
