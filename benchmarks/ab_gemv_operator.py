"""The bfloat16 one-row linear kernel's operator: its C++ kernel against its Python kernel.

``specontext::cpu_gemv_bf16`` (runtime/cpu_gemv.py) is served by a C++ kernel registered with
the dispatcher where torch ships its stable C ABI (csrc/gemv_bf16.cpp), else by a Python kernel
that calls the same C function through ctypes. This runs ``benchmarks.decode`` (8K random KV,
batch 1, bf16, own dense and the default) with one of the two, so alternating runs give an A/B
of the operator's dispatch alone (121 calls a step of SmolLM2)::

    python -m benchmarks.ab_gemv_operator cpp out/a.json
    python -m benchmarks.ab_gemv_operator python out/b.json

``python``: the kernel library is loaded without its operator kernel (the Python kernel serves).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import runpy
import sys


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=["cpp", "python"], help="which kernel serves the operator")
    parser.add_argument("json", help="benchmarks.decode's --json")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    if args.kernel == "python":
        _python_kernel_only()
    sys.argv = ["benchmarks.decode", "--contexts", "8192", "--random-contexts", "--batches", "1", "--contenders",
                "own-dense", "specontext-1024", "--dtypes", "bf16", "--steps", str(args.steps), "--json", args.json,
                "--no-plots", "--no-progress"]
    runpy.run_module("benchmarks.decode", run_name="__main__")


if __name__ == "__main__":
    main()
