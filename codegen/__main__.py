"""Command line of the Triton kernels (``codegen/kernels.py``).

    python -m specontext_compile.codegen show --head-dim 128 --group 4 --dtype bf16
    python -m specontext_compile.codegen compile --grid        # build for sm_90, no GPU

``show`` prints how one spec specialises the kernels (their ``tl.constexpr`` arguments, grids
and launch options); ``compile`` builds specs for an NVIDIA target without a GPU. The kernels' measured errors against float64 are a benchmark:
``python -m benchmarks.kernel_errors`` (bounds stated in ``codegen/accuracy.py``).
"""

from __future__ import annotations

import argparse
import os
import sys


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
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
    from .spec import KernelSpec

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


def specialisation(spec) -> str:
    """What ``spec`` sets when it launches the kernels of ``codegen/kernels.py`` (GPU mode)."""
    from .launch import KERNELS_FILE, split_constexprs, split_kernel_name

    constexprs = " ".join(f"{k}={v}" for k, v in split_constexprs(spec).items())
    return (
        f"# {spec.name}: the kernels of {KERNELS_FILE}\n"
        f"{split_kernel_name(spec)}[(batch, num_kv_heads * {spec.row_tiles}, num_splits)]"
        f" num_warps={spec.num_warps} num_stages={spec.num_stages}\n"
        f"    {constexprs}\n"
        f"sparse_decode_merge_kernel[(batch, num_heads, {spec.q_len})] num_warps=4\n"
        f"    HEAD_DIM_V={spec.head_dim_v} BLOCK_DV={spec.block_dv} BLOCK_S=next_power_of_2(num_splits)\n"
    )


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        spec = _spec_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(specialisation(spec))
    return 0


def _compile_grid() -> list:
    from .spec import KernelSpec

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
    show = sub.add_parser("show", help="print how one spec specialises the kernels (constexprs, grids)")
    _add_spec_arguments(show)
    build = sub.add_parser(
        "compile",
        help="compile for an NVIDIA target without a GPU and "
        "print registers / spills / shared memory",
    )
    _add_spec_arguments(build)
    build.add_argument("--arch", type=int, default=90, help="compute capability (90: H100)")
    build.add_argument("--grid", action="store_true", help="a representative set of specs")
    args = parser.parse_args(argv)
    commands = {"show": _cmd_show, "compile": _cmd_compile}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
