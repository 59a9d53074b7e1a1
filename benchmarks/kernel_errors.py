"""Measured error of the generated sparse decode attention kernels against float64.

    python -m benchmarks.kernel_errors --cases 40

Runs random cases (:mod:`benchmarks.attention_cases`) of every spec dimension (dtype,
head_dim, GQA group, query rows, soft cap, sliding window, MLA) against the float64
reference, under the Triton interpreter when no CUDA device is present (set before triton is
imported), and prints the measured error in units of ``u * (|ref| + max|v|)`` next to the
bound the kernels state (``specontext_compile.codegen.accuracy``). Exits 1 when a dtype's
worst case exceeds its bound.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def error_grid(cases: int) -> list[dict]:
    """One row per spec dimension value; each row is measured over ``cases`` seeds."""
    rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        for head_dim in (64, 80, 96, 128, 256):
            rows.append({"dtype": dtype, "head_dim": head_dim, "group": 4})
        for group in (1, 2, 3, 6, 7, 8):
            rows.append({"dtype": dtype, "head_dim": 64, "group": group})
        for q_len in (2, 16):
            rows.append({"dtype": dtype, "head_dim": 64, "group": 2, "q_len": q_len})
        rows.append({"dtype": dtype, "head_dim": 64, "group": 2, "q_len": 3, "soft_cap": 20.0})
        rows.append({"dtype": dtype, "head_dim": 64, "group": 2, "q_len": 3, "sliding_window": 9})
        rows.append({"dtype": dtype, "head_dim": 64, "group": 4, "rope_dim": 32})
    return [dict(row, cases=cases) for row in rows]


def measure(row: dict, seed0: int) -> float:
    """The worst error ratio of one grid row over its seeds."""
    from specontext_compile.codegen.accuracy import error_ratio

    from benchmarks.attention_cases import make_attention_case

    worst = 0.0
    params = {k: v for k, v in row.items() if k != "cases"}
    for seed in range(seed0, seed0 + row["cases"]):
        case = make_attention_case(seed=seed, batch=2, num_kv=2, lengths=[37, 1 + seed % 29], budget=48,
                                   fill=0.8, logit_scale=1.0 + 3 * (seed % 2), **params)
        out = case.run(num_splits=1 + seed % 3, block_n=16)
        worst = max(worst, error_ratio(out, case.reference(), case.value_scale, row["dtype"]))
    return worst


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8, help="random cases per spec row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from specontext_compile.codegen.accuracy import ERROR_BOUND, UNIT_ROUNDOFF

    start = time.time()
    print(f"{'dtype':5} {'spec':48} {'max err [u]':>12} {'bound [u]':>10} {'err/(|ref|+max|v|)':>19}")
    per_dtype: dict[str, float] = {}
    for row in error_grid(args.cases):
        ratio = measure(row, args.seed)
        dtype = row["dtype"]
        per_dtype[dtype] = max(per_dtype.get(dtype, 0.0), ratio)
        label = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("dtype", "cases"))
        print(f"{dtype:5} {label:48} {ratio:12.3f} {ERROR_BOUND[dtype]:10.1f} {ratio * UNIT_ROUNDOFF[dtype]:19.3e}")
    print("worst per dtype (units of u*(|ref|+max|v|)):", {k: round(v, 3) for k, v in per_dtype.items()},
          f"({time.time() - start:.0f} s)")
    return 0 if all(per_dtype[d] <= ERROR_BOUND[d] for d in per_dtype) else 1


if __name__ == "__main__":
    sys.exit(main())
