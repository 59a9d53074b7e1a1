"""Command line of the kernel generator.

    python -m specontext_compile.codegen show --head-dim 128 --group 4 --dtype bf16
    python -m specontext_compile.codegen show --kind retrieval --head-dim 64 --group 4
    python -m specontext_compile.codegen errors --cases 40     # measured error bounds
    python -m specontext_compile.codegen compile --grid        # build for sm_90, no GPU

``show`` prints the generated Triton source of one spec. ``errors`` runs random cases of every
spec dimension against the float64 reference (under the Triton interpreter when no CUDA
device is present; set before triton is imported) and prints the measured error in units of
``u * (|ref| + max|v|)`` next to the stated bound (see ``codegen/accuracy.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("attention", "retrieval"), default="attention")
    parser.add_argument("--head-dim", type=int, default=128, help="key width (MLA: latent)")
    parser.add_argument("--head-dim-v", type=int, default=0, help="value width (0: head-dim)")
    parser.add_argument("--rope-dim", type=int, default=0, help="MLA RoPE width (0: no MLA)")
    parser.add_argument("--group", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--dtype", default="bf16", help="fp32, bf16 or fp16")
    parser.add_argument("--q-len", type=int, default=1, help="query tokens per step (1..16)")
    parser.add_argument("--soft-cap", action="store_true", help="logit soft-capping")
    parser.add_argument("--sliding-window", action="store_true", help="sliding window")
    parser.add_argument("--block-n", type=int, default=0, help="entries per step (0: auto)")


def _spec_from_args(args: argparse.Namespace):
    from .spec import KernelSpec, RetrievalSpec

    if args.kind == "retrieval":
        return RetrievalSpec(
            head_dim=args.head_dim, group=args.group, dtype=args.dtype, block_n=args.block_n
        )
    return KernelSpec(
        head_dim=args.head_dim,
        head_dim_v=args.head_dim_v,
        rope_dim=args.rope_dim,
        group=args.group,
        dtype=args.dtype,
        q_len=args.q_len,
        soft_cap=args.soft_cap,
        sliding_window=args.sliding_window,
        block_n=args.block_n,
    )


def _cmd_show(args: argparse.Namespace) -> int:
    from .generator import generated_source

    try:
        spec = _spec_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(generated_source(spec))
    return 0


def _error_grid(cases: int) -> list[dict]:
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


def _measure(row: dict, seed0: int) -> float:
    from .accuracy import error_ratio
    from .testing import make_attention_case

    worst = 0.0
    params = {k: v for k, v in row.items() if k != "cases"}
    for seed in range(seed0, seed0 + row["cases"]):
        case = make_attention_case(
            seed=seed,
            batch=2,
            num_kv=2,
            lengths=[37, 1 + seed % 29],
            budget=48,
            fill=0.8,
            logit_scale=1.0 + 3 * (seed % 2),
            **params,
        )
        out = case.run(num_splits=1 + seed % 3, block_n=16)
        worst = max(worst, error_ratio(out, case.reference(), case.value_scale, row["dtype"]))
    return worst


def _cmd_errors(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .accuracy import ERROR_BOUND, UNIT_ROUNDOFF

    start = time.time()
    print(
        f"{'dtype':5} {'spec':48} {'max err [u]':>12} {'bound [u]':>10} {'err/(|ref|+max|v|)':>19}"
    )
    per_dtype: dict[str, float] = {}
    for row in _error_grid(args.cases):
        ratio = _measure(row, args.seed)
        dtype = row["dtype"]
        per_dtype[dtype] = max(per_dtype.get(dtype, 0.0), ratio)
        label = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("dtype", "cases"))
        print(
            f"{dtype:5} {label:48} {ratio:12.3f} {ERROR_BOUND[dtype]:10.1f} "
            f"{ratio * UNIT_ROUNDOFF[dtype]:19.3e}"
        )
    print(
        "worst per dtype (units of u*(|ref|+max|v|)):",
        {k: round(v, 3) for k, v in per_dtype.items()},
        f"({time.time() - start:.0f} s)",
    )
    return 0 if all(per_dtype[d] <= ERROR_BOUND[d] for d in per_dtype) else 1


def _compile_grid() -> list:
    from .spec import KernelSpec, RetrievalSpec

    specs = [KernelSpec(head_dim=128, group=g, dtype="bf16") for g in (4, 8)]
    specs += [KernelSpec(head_dim=d, group=4, dtype="bf16") for d in (64, 80, 96, 256)]
    specs += [KernelSpec(head_dim=128, group=g, dtype="bf16") for g in (1, 3, 6, 7)]
    specs += [KernelSpec(head_dim=128, group=4, dtype=t) for t in ("fp16", "fp32")]
    specs += [
        KernelSpec(head_dim=128, group=4, dtype="bf16", q_len=16),
        KernelSpec(
            head_dim=128, group=2, dtype="bf16", q_len=4, soft_cap=True, sliding_window=True
        ),
        KernelSpec(head_dim=512, rope_dim=64, group=16, dtype="bf16"),
        RetrievalSpec(head_dim=128, group=4, dtype="bf16"),
    ]
    return specs


def _cmd_compile(args: argparse.Namespace) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice
    from .aot import compile_for_target

    specs = _compile_grid() if args.grid else [_spec_from_args(args)]
    print(f"{'kernel spec':58} {'kernel':28} {'regs':>5} {'spill B':>8} {'smem B':>7} warps")
    failures = 0
    for spec in specs:
        try:
            builds = compile_for_target(spec, arch=args.arch)
        except Exception as exc:  # noqa: BLE001 - report every spec, then fail
            failures += 1
            print(f"{spec.name:58} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        for b in builds:
            print(
                f"{spec.name:58} {b.name:28} {b.registers:5d} {b.spill_bytes:8d} "
                f"{b.shared_bytes:7d} {b.num_warps:5d}"
            )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m specontext_compile.codegen", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the generated Triton source of one spec")
    _add_spec_arguments(show)
    errors = sub.add_parser("errors", help="measure kernel errors against float64")
    errors.add_argument("--cases", type=int, default=8, help="random cases per spec row")
    errors.add_argument("--seed", type=int, default=0)
    build = sub.add_parser(
        "compile",
        help="compile for an NVIDIA target without a GPU and "
        "print registers / spills / shared memory",
    )
    _add_spec_arguments(build)
    build.add_argument("--arch", type=int, default=90, help="compute capability (90: H100)")
    build.add_argument("--grid", action="store_true", help="a representative set of specs")
    args = parser.parse_args(argv)
    commands = {"show": _cmd_show, "errors": _cmd_errors, "compile": _cmd_compile}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
