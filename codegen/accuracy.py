"""Error measure and per-dtype error bounds of the sparse decode attention kernels.

The kernel computes in fp32 but stores in the input dtype and feeds the softmax weights to
the ``p @ v`` product in that dtype (as flash-attention kernels do). With ``u`` the unit
roundoff of the storage dtype, a first-order bound of the error against the exact result
(computed in float64 from the same rounded inputs) is::

    |out - ref| <= u * |ref|                 (rounding of the output)
                 + u * max_selected |v|      (rounding of the weights p before p @ v)
                 + fp32 terms                (dot products, exp, merge: ~1e-6 relative)

so we state bounds as ``|out - ref| <= c_dtype * u * (|ref| + max|v|)`` and measure the
ratio ``max |out - ref| / (u * (|ref| + max|v|))`` ("error in units of u"). For fp32 the
fp32 terms dominate, so ``c`` is larger there. Bounds are asserted by the property tests and
the measured ratios are printed by ``python -m benchmarks.kernel_errors``.
"""

from __future__ import annotations

import torch

from .spec import canonical_dtype

__all__ = ["ERROR_BOUND", "UNIT_ROUNDOFF", "assert_within_bound", "error_ratio"]

#: unit roundoff 2**-p (p = significand bits incl. the implicit one) per storage dtype
UNIT_ROUNDOFF: dict[str, float] = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}

#: stated bound ``c_dtype`` in units of ``u * (|ref| + max|v|)`` (see module docstring)
ERROR_BOUND: dict[str, float] = {"fp32": 256.0, "bf16": 2.0, "fp16": 2.0}


def error_ratio(
    out: torch.Tensor, ref: torch.Tensor, value_scale: float, dtype: str | torch.dtype
) -> float:
    """``max |out - ref| / (u * (|ref| + value_scale))``; ``inf`` if ``out`` has NaN/inf
    where ``ref`` is finite (so NaN never passes a bound).

    Args:
        out: kernel output (any dtype). ref: float64 reference of the same shape.
        value_scale: ``max |v|`` over the values that may be attended (>= 0).
        dtype: storage dtype of the kernel inputs.
    """
    u = UNIT_ROUNDOFF[canonical_dtype(dtype)]
    out64 = out.to(torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    if out.numel() == 0:
        return 0.0
    err = (out64 - ref).abs() / (u * (ref.abs() + value_scale) + 1e-300)
    return float(err.max())


def assert_within_bound(
    out: torch.Tensor,
    ref: torch.Tensor,
    value_scale: float,
    dtype: str | torch.dtype,
    context: str = "",
) -> float:
    """Assert ``error_ratio <= ERROR_BOUND[dtype]``; returns the ratio.

    Raises:
        AssertionError: with the worst element, both values and the ratio.
    """
    name = canonical_dtype(dtype)
    ratio = error_ratio(out, ref, value_scale, name)
    if ratio <= ERROR_BOUND[name]:
        return ratio
    out64 = out.to(torch.float64)
    diff = torch.where(
        torch.isfinite(out64), (out64 - ref).abs(), torch.full_like(ref, float("inf"))
    )
    worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0].tolist())
    raise AssertionError(
        f"{context}: error {ratio:.3g} u exceeds the {name} bound {ERROR_BOUND[name]} u "
        f"(u={UNIT_ROUNDOFF[name]:.3g}, max|v|={value_scale:.3g}); worst at {worst}: "
        f"out={float(out64[worst])!r} ref={float(ref[worst])!r}"
    )
