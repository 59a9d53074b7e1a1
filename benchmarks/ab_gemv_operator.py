"""The bfloat16 one-row linear kernel's operator: its C++ kernel against its Python kernel.

``specontext::cpu_gemv_bf16`` (runtime/cpu_gemv.py) is served by a C++ kernel registered with
the dispatcher where torch ships its stable C ABI (csrc/gemv_bf16.cpp), else by a Python kernel
that calls the same C function through ctypes. This runs ``benchmarks.decode`` (8K random KV,
batch 1, bf16, own dense and the default) with one of the two, so alternating runs give an A/B
of the operator's dispatch alone (121 calls a step of SmolLM2)::

    python -m benchmarks.ab_gemv_operator cpp out/a.json
    python -m benchmarks.ab_gemv_operator python out/b.json

``python``: the kernel library is loaded without its operator kernel (the Python kernel serves).
``--call-cost``: instead, the time of one call on an 8-row weight (the fixed cost of a call)
beside a tiny ``aten::add``, median of 5 rounds of 3000 calls, written to the JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import runpy
import statistics
import sys
import time


def _python_kernel_only() -> None:
    """Make ``cpu_gemv`` load its library without the C++ operator kernel."""
    from specontext_compile.runtime import cpu_gemv, cpu_kernels

    @functools.cache
    def plain() -> ctypes.CDLL:
        lib = cpu_kernels.load_kernels(cpu_gemv._SOURCE, ("specontext_gemv_bf16",),
                                       [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2)
        lib.specontext_gemv_bf16_native.restype = ctypes.c_int
        lib.specontext_gemv_bf16_native.argtypes = []
        return lib

    cpu_gemv._library = plain


def _call_cost(kernel: str, path: str) -> None:
    """Microseconds a call: the operator on a bfloat16 [8, 576] weight, and ``aten::add`` of two
    576-element rows."""
    import torch

    from specontext_compile.runtime import cpu_gemv

    cpu_gemv.available()  # the library loaded (with its C++ operator kernel for "cpp")
    x, weights = torch.randn(576, dtype=torch.bfloat16), [torch.randn(8, 576, dtype=torch.bfloat16)]

    def per_call(fn) -> float:
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(3000):
                fn()
            rounds.append((time.perf_counter() - start) / 3000 * 1e6)
        return statistics.median(rounds)

    cost = {"kernel": kernel, "gemv_tiny_call_us": per_call(lambda: torch.ops.specontext.cpu_gemv_bf16(x, weights)),
            "aten_add_tiny_call_us": per_call(lambda: torch.ops.aten.add.Tensor(x, x)),
            "command": "python -m benchmarks.ab_gemv_operator " + " ".join(sys.argv[1:])}
    with open(path, "w") as out:
        json.dump(cost, out, indent=2)
    print(cost)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=["cpp", "python"], help="which kernel serves the operator")
    parser.add_argument("json", help="benchmarks.decode's --json")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--call-cost", action="store_true", help="time one tiny call instead of decode steps")
    args = parser.parse_args(argv)
    if args.kernel == "python":
        _python_kernel_only()
    if args.call_cost:
        _call_cost(args.kernel, args.json)
        return
    sys.argv = ["benchmarks.decode", "--contexts", "8192", "--random-contexts", "--batches", "1", "--contenders",
                "own-dense", "specontext-1024", "--dtypes", "bf16", "--steps", str(args.steps), "--json", args.json,
                "--no-plots", "--no-progress"]
    runpy.run_module("benchmarks.decode", run_name="__main__")


if __name__ == "__main__":
    main()
