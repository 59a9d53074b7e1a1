"""Our CPU kernel for a one-row bfloat16 linear layer: the decode step's weights read near the copy rate.

A decode step of batch 1 multiplies one activation row by every weight matrix, so its cost is
reading the weights. ``passes/gemv.py`` turns each one-row ``linear`` into inductor's fused
multiply-and-sum, which reads float32 weights near the copy rate but bfloat16 ones at about
11 GB/s on a 2-core Xeon whose copy runs at 26 (``aten::mm`` no faster; ``python -m
benchmarks.linear_bandwidth bfloat16``). ``specontext::cpu_gemv_bf16``
(``csrc/gemv_bf16.cpp``) computes the same product with AVX512_BF16's ``vdpbf16ps``, four
output rows per load of the input row: float32 accumulation, the sum rounded to bfloat16 once,
as inductor's reduction rounds it (the additions' order differs; bfloat16 denormals read as
zero). The pass uses it only where it is the faster path: CPU bfloat16 weights and input row,
a library built with AVX512_BF16, and a CPU of the kind where it was measured faster in the
compiled step (:func:`faster_here`); elsewhere inductor's reduction stays (:func:`applies`).
One call takes every weight of one input row (a layer's query, key and value projections):
one dispatch and one parallel region for them (:func:`one_row_linears`).
Built like the other CPU kernels (:func:`.cpu_kernels.build_library`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_kernels
from .torch_private import counters, cpu_has_amx

__all__ = ["applies", "available", "cpu_gemv_bf16", "faster_here", "native", "one_row_linear", "one_row_linears"]

_SOURCE = Path(__file__).with_name("csrc") / "gemv_bf16.cpp"


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_kernels.load_kernels(_SOURCE, ("specontext_gemv_bf16",), [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2,
                                   op_calls="cpu_kernel_gemv_calls")
    lib.specontext_gemv_bf16_native.restype = ctypes.c_int
    lib.specontext_gemv_bf16_native.argtypes = []
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel library builds and loads here (the reason logged once if not)."""
    return cpu_kernels.loads(_library, "the CPU bfloat16 one-row linear kernel",
                             "bfloat16 one-row linear layers keep inductor's reduction")


@functools.cache
def native() -> bool:
    """Whether the library was built with AVX512_BF16 (``vdpbf16ps``): without it the kernel
    is no faster than inductor's reduction, so :func:`applies` says no."""
    return available() and bool(_library().specontext_gemv_bf16_native())


@functools.cache
def faster_here() -> bool:
    """Whether this CPU is of the kind where the kernel made the compiled bfloat16 step faster
    than inductor's reduction: one with AMX (Intel Sapphire Rapids and later; a proxy, not a
    cause). Measured with ``python -m benchmarks.ab_step --swap no-gemv-kernel --dtype
    bfloat16`` (docs/benchmarks.md): on a 2-core Xeon with AMX the step without the kernel took
    1.103x as long; on a 2-core AMD EPYC (Zen 4: AVX512_BF16, no AMX) 0.80x, the kernel the
    slower path there (not traced further: Zen 4 runs 512-bit instructions as two halves, and
    inductor's reduction read the weights about as fast as the kernel did alone)."""
    return cpu_has_amx()


def applies(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``passes/gemv.py`` sends a one-row ``linear(input, weight)`` here (a static fact,
    read from the traced example values): CPU bfloat16 input and weight, the weight 2-D, row
    major and contiguous with static sizes, no gradient to carry (the op has no backward: a
    graph traced with gradients keeps inductor's reduction), :func:`native`, and
    :func:`faster_here`."""
    grad = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    return (not grad and input.device.type == "cpu" and weight.device.type == "cpu" and input.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and all(isinstance(n, int) for n in (*weight.shape, *weight.stride()))
            and weight.is_contiguous() and weight.shape[0] > 0 and weight.shape[1] > 0 and native()
            and faster_here())


def one_row_linear(input: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(input, weight, bias)`` for a one-row bfloat16 ``input`` ``[..., in_features]``
    through :func:`cpu_gemv_bf16`; returns ``[..., out_features]`` bfloat16."""
    out = torch.ops.specontext.cpu_gemv_bf16(input.reshape(-1), [weight])[0].reshape(*input.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def one_row_linears(input: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``linear(input, w)`` for each of ``weights`` (bias-free, one input row: a layer's query,
    key and value projections) in one call of :func:`cpu_gemv_bf16`; each ``[...,
    out_features]`` bfloat16."""
    outs = torch.ops.specontext.cpu_gemv_bf16(input.reshape(-1), list(weights))
    return tuple(out.reshape(*input.shape[:-1], w.shape[0]) for out, w in zip(outs, weights))


# A plain torch.library op (as the other CPU kernels: a cheaper dispatch than custom_op's; no
# backward: the pass rewrites only graphs compiled for inference, see passes/gemv.py).
torch.library.define("specontext::cpu_gemv_bf16", "(Tensor input, Tensor[] weights) -> Tensor[]")

_MAX_WEIGHTS = 16  # csrc/gemv_bf16.cpp


def cpu_gemv_bf16(input: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``w @ input`` for one bfloat16 row and each of ``weights``, in one kernel call.

    Args:
        input: bfloat16 ``[in_features]`` on the CPU (copied when not contiguous).
        weights: 1 to 16 contiguous bfloat16 CPU tensors ``[out_features_k, in_features]``.

    Returns:
        bfloat16 ``[out_features_k]`` per weight: each output the float32 sum of its products,
        rounded once.

    Raises:
        KernelBuildError: the library cannot be built here (see :func:`available`).
        ValueError: another dtype, device, layout or size, named before any read.
    """
    if (input.dtype != torch.bfloat16 or input.device.type != "cpu" or input.dim() != 1 or input.shape[0] == 0
            or not 1 <= len(weights) <= _MAX_WEIGHTS):
        raise ValueError(f"cpu_gemv_bf16 takes a bfloat16 CPU input [in_features >= 1] and 1 to {_MAX_WEIGHTS} "
                         f"weights; got input {input.dtype} {tuple(input.shape)} on {input.device}, "
                         f"{len(weights)} weights")
    for weight in weights:
        if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
                or weight.shape[1] != input.shape[0] or not weight.is_contiguous() or weight.shape[0] == 0):
            raise ValueError(f"cpu_gemv_bf16 takes contiguous bfloat16 CPU weights [out_features >= 1, "
                             f"in_features={input.shape[0]}]; got weight {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device} (contiguous: {weight.is_contiguous()})")
    counters["specontext"]["cpu_kernel_gemv_calls"] += 1
    x = input.contiguous()
    outs = [torch.empty(w.shape[0], dtype=torch.bfloat16) for w in weights]
    count = len(weights)
    pointers = ctypes.c_void_p * count
    _library().specontext_gemv_bf16(pointers(*(w.data_ptr() for w in weights)), x.data_ptr(),
                                    pointers(*(o.data_ptr() for o in outs)),
                                    (ctypes.c_int64 * count)(*(w.shape[0] for w in weights)), count, x.shape[0])
    return outs


# the operator's CPU kernel is C++ where the library is built with it (csrc/gemv_bf16.cpp,
# csrc/torch_op.h: no Python per call); this Python kernel serves it elsewhere
torch.library.impl("specontext::cpu_gemv_bf16", "CompositeExplicitAutograd")(cpu_gemv_bf16)


@torch.library.register_fake("specontext::cpu_gemv_bf16")
def _(input, weights):
    return [input.new_empty(w.shape[0]) for w in weights]
