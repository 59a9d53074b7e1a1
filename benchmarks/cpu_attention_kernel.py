"""How fast our CPU dense decode attention kernel reads a KV store, alone, against ``torch.sum``.

SmolLM2-135M's shape (30 layers, 3 KV heads of 9 query heads, head_dim 64), a random store of
``--context`` tokens per layer (each layer its own tensors, so a pass reads them from memory
and not from the cache), one query row per head: the median time of one call per layer
(``specontext::cpu_decode_attention``, ``runtime/csrc/decode_attention.cpp``), the bytes it
must read (keys and values), and ``torch.sum`` over the same bytes as the read rate to compare
with. Also checks the output against float64 attention. Source of the "alone" figures in
docs/benchmarks.md, "The dense kernel's rows prefetched".

    python -m benchmarks.cpu_attention_kernel --dtypes float32 bfloat16 --json docs/results/cpu_attention_kernel_8k_2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specontext_compile.runtime import cpu_kernels

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(dtype: torch.dtype, context: int, repeats: int) -> dict:
    """One dtype's row: kernel and ``torch.sum`` medians (ms) and rates (GB/s), max error."""
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    query = torch.randn(1, KV_HEADS * GROUP, 1, HEAD_DIM, generator=gen) * HEAD_DIM ** -0.5
    length = torch.tensor(context)
    nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))

    def kernel():
        for k, v in zip(keys, values):
            cpu_kernels.cpu_decode_attention(query, k, v, length, None)

    def read():
        for k, v in zip(keys, values):
            k.sum()
            v.sum()

    kernel_s, read_s = _median_s(kernel, repeats), _median_s(read, repeats)
    out = cpu_kernels.cpu_decode_attention(query, keys[0], values[0], length, None)
    k64 = keys[0].double().repeat_interleave(GROUP, 1)
    v64 = values[0].double().repeat_interleave(GROUP, 1)
    ref = torch.softmax(query.double() @ k64.transpose(-1, -2), -1) @ v64
    return {"dtype": str(dtype).removeprefix("torch."), "context": context, "bytes": nbytes,
            "kernel_ms": 1e3 * kernel_s, "kernel_gb_s": nbytes / kernel_s / 1e9,
            "torch_sum_ms": 1e3 * read_s, "torch_sum_gb_s": nbytes / read_s / 1e9,
            "max_abs_error_vs_float64": float((out.double() - ref).abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_attention_kernel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from benchmarks.decode import machine_info

    rows = [measure(getattr(torch, name), args.context, args.repeats) for name in args.dtypes]
    for r in rows:
        print(f"{r['dtype']}: kernel {r['kernel_ms']:.1f} ms ({r['kernel_gb_s']:.1f} GB/s) for 30 layers, "
              f"torch.sum {r['torch_sum_ms']:.1f} ms ({r['torch_sum_gb_s']:.1f} GB/s), "
              f"max error vs float64 {r['max_abs_error_vs_float64']:.1e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": "python -m benchmarks.cpu_attention_kernel " + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": machine_info(), "threads": torch.get_num_threads(), "rows": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
