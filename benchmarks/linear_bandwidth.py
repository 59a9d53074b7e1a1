"""How fast one decode step's weights are read: ``aten::mm`` of one row vs the fused
multiply-and-sum of ``passes/gemv.py`` compiled by inductor, vs a copy (the floor's rate).

SmolLM2-135M's linear layers in fp32 (538 MB: Q/K/V/O, MLP, LM head), random values, batch
1; the median of 7 passes over all of them. Source of the figures in ``passes/gemv.py``.

    python -m benchmarks.linear_bandwidth
    python -m benchmarks.linear_bandwidth bfloat16     # the same weights in bf16 (269 MB), and our bf16 kernel
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specontext_compile.passes.gemv import one_row_linear
from specontext_compile.runtime import cpu_gemv

# (out_features, in_features) of one SmolLM2-135M decode step: 30 layers, then the LM head
SHAPES = ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
          + [(49152, 576)])


def _median_s(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dtype = getattr(torch, args[0]) if args else torch.float32
    torch.manual_seed(0)
    weights = [torch.randn(o, i, dtype=dtype) for o, i in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows = {k: torch.randn(1, k, dtype=dtype) for k in {i for _, i in SHAPES}}
    fused = torch.compile(one_row_linear, backend="inductor")
    with torch.no_grad():
        for w in weights:
            torch.testing.assert_close(fused(rows[w.shape[1]], w), torch.nn.functional.linear(rows[w.shape[1]], w),
                                       atol=1e-3 if dtype == torch.float32 else 0.5, rtol=1e-4 if dtype == torch.float32 else 2e-2)
        mm = _median_s(lambda: [torch.nn.functional.linear(rows[w.shape[1]], w) for w in weights])
        gemv = _median_s(lambda: [fused(rows[w.shape[1]], w) for w in weights])
        ours = None
        if dtype == torch.bfloat16 and cpu_gemv.native():  # our kernel (runtime/cpu_gemv.py), one op call per layer
            ours = _median_s(lambda: [cpu_gemv.one_row_linear(rows[w.shape[1]], w) for w in weights])
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        copy = _median_s(lambda: dst.copy_(src))
    print(f"weights {nbytes / 1e6:.0f} MB ({dtype}), {torch.get_num_threads()} threads")
    print(f"aten::mm (F.linear, one row):     {mm * 1e3:6.1f} ms  {nbytes / mm / 1e9:5.1f} GB/s read")
    print(f"fused (w * x).sum(-1), inductor:  {gemv * 1e3:6.1f} ms  {nbytes / gemv / 1e9:5.1f} GB/s read "
          "(includes one compiled-call overhead per layer)")
    if ours is not None:
        print(f"specontext::cpu_gemv_bf16 (ours):  {ours * 1e3:6.1f} ms  {nbytes / ours / 1e9:5.1f} GB/s read "
              "(includes one op dispatch per layer)")
    print(f"copy of the same bytes:           {copy * 1e3:6.1f} ms  {2 * nbytes / copy / 1e9:5.1f} GB/s read + write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
