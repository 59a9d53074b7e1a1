"""How fast our CPU decode attention kernels read a KV store, alone, against ``torch.sum``.

SmolLM2-135M's shape (30 layers, 3 KV heads of 9 query heads, head_dim 64), a random store of
``--context`` tokens per layer (each layer its own tensors, so a pass reads them from memory
and not from the cache), one query row per head: the median time of one call per layer, the
bytes the call must read, and ``torch.sum`` over the same bytes as the read rate to compare
with, the two interleaved (this machine's rate moves from minute to minute). Kernels:

* ``dense``: ``specontext::cpu_decode_attention`` (``runtime/csrc/decode_attention.cpp``) over
  the whole store: keys and values; the output checked against float64 attention;
* ``refine``: ``specontext::cpu_refine_attention`` (``runtime/csrc/refine_attention.cpp``)
  with the default options' arguments (budget 1024 of 1024 selected candidates, sorted random
  positions with the sinks and the recent window, a page rescue of 128 pages of 16 tokens,
  4 sinks, a recent window of 64): the page bounds, the candidates' and rescued tokens' keys
  and the kept tokens' values (scattered rows), against ``torch.sum`` over as many bytes of
  the stores;
* ``selection``: ``specontext::cpu_selection_scores`` (``runtime/csrc/selection_scores.cpp``),
  the default head's scores once per step: the keys of the 8 retrieval layers (of the 30 stores).
* ``selection-int8``: the same kernel over the same keys as int8 levels and one float32 scale a
  row (``runtime/int8_keys.py``, the form of an 8-bit KV store), beside the kernel over the
  keys themselves.

``--group`` and ``--head-dim`` change the shape (query heads per KV head, head size): the
kernels unroll a few shapes (SmolLM2's 3 x 64 among them) and run generic loops for the rest.

Source of the "alone" figures in docs/benchmarks.md, "How the step got here".

    python -m benchmarks.cpu_attention_kernel --kernels dense refine selection --dtypes float32 bfloat16 --json docs/results/cpu_kernels_alone_far_prefetch_8k_2026-12-06_epyc.json
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


BUDGET, SINKS, RECENT, RESCUE_PAGES, PAGE_TOKENS = 1024, 4, 64, 128, 16  # the default options' refinement


def _medians_s(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and of ``second()``, called alternately ``repeats`` times
    after one warm-up call each."""
    return tuple(_medians((first, second), repeats))


def _medians(fns, repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up call each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _stores(dtype: torch.dtype, context: int, gen: torch.Generator):
    keys = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    query = torch.randn(1, KV_HEADS * GROUP, 1, HEAD_DIM, generator=gen) * HEAD_DIM ** -0.5
    return keys, values, query


def _row(kernel: str, dtype: torch.dtype, context: int, nbytes: int, kernel_s: float, read_s: float) -> dict:
    return {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "context": context, "bytes": nbytes,
            "kernel_ms": 1e3 * kernel_s, "kernel_gb_s": nbytes / kernel_s / 1e9,
            "torch_sum_ms": 1e3 * read_s, "torch_sum_gb_s": nbytes / read_s / 1e9}


def _candidates(context: int, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[1, KV_HEADS, BUDGET]``: the sinks, the recent window and sorted random positions between."""
    rows = []
    for _ in range(KV_HEADS):
        middle = torch.randperm(context - SINKS - RECENT, generator=gen)[:BUDGET - SINKS - RECENT] + SINKS
        rows.append(torch.cat([torch.arange(SINKS), middle, torch.arange(context - RECENT, context)]).sort().values)
    return torch.stack(rows)[None].contiguous()


def measure_refine(dtype: torch.dtype, context: int, repeats: int) -> dict:
    """The refine kernel's row (module docstring): its medians (ms) and rates (GB/s)."""
    from specontext_compile.runtime import cpu_refine  # noqa: F401  (defines the op)

    gen = torch.Generator().manual_seed(0)
    keys, values, query = _stores(dtype, context, gen)
    pages = context // PAGE_TOKENS
    bounds = [(k.view(1, KV_HEADS, pages, PAGE_TOKENS, HEAD_DIM).amin(3).contiguous(),
               k.view(1, KV_HEADS, pages, PAGE_TOKENS, HEAD_DIM).amax(3).contiguous()) for k in keys]
    candidates = [_candidates(context, gen) for _ in range(LAYERS)]
    length = torch.tensor(context)
    rows = 2 * pages + BUDGET + RESCUE_PAGES * PAGE_TOKENS + BUDGET  # bounds, scored keys, kept values
    per_layer = KV_HEADS * rows * HEAD_DIM * keys[0].element_size()
    nbytes = LAYERS * per_layer
    flat = [t.view(-1)[:per_layer // keys[0].element_size()] for t in keys]

    def kernel():
        for k, v, c, (lo, hi) in zip(keys, values, candidates, bounds):
            torch.ops.specontext.cpu_refine_attention(query, k, v, c, length, None, lo, hi, None, None, None, BUDGET,
                                                      SINKS, RECENT, RESCUE_PAGES, PAGE_TOKENS)

    def read():
        for t in flat:
            t.sum()

    return _row("refine", dtype, context, nbytes, *_medians_s(kernel, read, repeats))


def measure_selection(dtype: torch.dtype, context: int, repeats: int) -> dict:
    """The selection kernel's row (module docstring): its medians (ms) and rates (GB/s) for one
    call a step over 8 layers' keys, 30 calls timed (each over 8 of the 30 stores, in turn)."""
    from specontext_compile.config import default_retrieval_layers
    from specontext_compile.runtime import cpu_selection  # noqa: F401  (defines the op)

    gen = torch.Generator().manual_seed(0)
    keys, _, _ = _stores(dtype, context, gen)
    picks = default_retrieval_layers(LAYERS)
    query = (torch.randn(len(picks), 1, KV_HEADS * GROUP, 1, HEAD_DIM, generator=gen) * HEAD_DIM ** -0.5
             ).to(dtype).float()
    length = torch.tensor(context)
    calls = [[keys[(first + layer) % LAYERS] for layer in picks] for first in range(LAYERS)]
    nbytes = sum(k.numel() * k.element_size() for group in calls for k in group)

    def kernel():
        for group in calls:
            torch.ops.specontext.cpu_selection_scores(query, group, length, None)

    def read():
        for group in calls:
            for k in group:
                k.sum()

    return _row("selection", dtype, context, nbytes, *_medians_s(kernel, read, repeats))


def measure_selection_int8(dtype: torch.dtype, context: int, repeats: int) -> dict:
    """The selection kernel over int8 keys (``selection-int8``): the same calls as
    :func:`measure_selection`, each store's keys as int8 levels and float32 row scales
    (``runtime/int8_keys.py``); ``torch.sum`` over the levels' and the scales' bytes (the levels
    read as float32); ``store_kernel_ms``:
    the kernel over the ``dtype`` keys themselves, timed in turn with the other two. The
    scores' largest difference from the ``dtype`` keys' kernel is kept as ``max_abs_score_diff``
    (the scores sum 8 layers' softmax weights: at most 8)."""
    from specontext_compile.config import default_retrieval_layers
    from specontext_compile.runtime import cpu_selection, int8_keys  # noqa: F401  (defines the op)

    gen = torch.Generator().manual_seed(0)
    keys, _, _ = _stores(dtype, context, gen)
    rows = [int8_keys.quantize_rows(k) for k in keys]
    picks = default_retrieval_layers(LAYERS)
    query = (torch.randn(len(picks), 1, KV_HEADS * GROUP, 1, HEAD_DIM, generator=gen) * HEAD_DIM ** -0.5
             ).to(dtype).float()
    length = torch.tensor(context)
    calls = [[(first + layer) % LAYERS for layer in picks] for first in range(LAYERS)]
    nbytes = sum(t.numel() * t.element_size() for group in calls for i in group for t in rows[i])

    def kernel():
        for group in calls:
            torch.ops.specontext.cpu_selection_scores(query, [rows[i][0] for i in group], length, None,
                                                      [rows[i][1] for i in group])

    def store_kernel():
        for group in calls:
            torch.ops.specontext.cpu_selection_scores(query, [keys[i] for i in group], length, None)

    def read():  # the levels' bytes summed as float32 (torch's int8 sum runs far below the bandwidth)
        for group in calls:
            for i in group:
                rows[i][0].view(torch.float32).sum()
                rows[i][1].sum()

    kernel_s, read_s, store_s = _medians((kernel, read, store_kernel), repeats)
    group = calls[0]
    diff = (torch.ops.specontext.cpu_selection_scores(query, [rows[i][0] for i in group], length, None,
                                                      [rows[i][1] for i in group])
            - torch.ops.specontext.cpu_selection_scores(query, [keys[i] for i in group], length, None)).abs().max()
    return {**_row("selection-int8", dtype, context, nbytes, kernel_s, read_s), "store_kernel_ms": 1e3 * store_s,
            "max_abs_score_diff": float(diff)}


def measure(dtype: torch.dtype, context: int, repeats: int) -> dict:
    """The dense kernel's row: kernel and ``torch.sum`` medians (ms) and rates (GB/s), max error."""
    gen = torch.Generator().manual_seed(0)
    keys, values, query = _stores(dtype, context, gen)
    length = torch.tensor(context)
    nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))

    def kernel():
        for k, v in zip(keys, values):
            cpu_kernels.cpu_decode_attention(query, k, v, length, None)

    def read():
        for k, v in zip(keys, values):
            k.sum()
            v.sum()

    row = _row("dense", dtype, context, nbytes, *_medians_s(kernel, read, repeats))
    out = cpu_kernels.cpu_decode_attention(query, keys[0], values[0], length, None)
    k64 = keys[0].double().repeat_interleave(GROUP, 1)
    v64 = values[0].double().repeat_interleave(GROUP, 1)
    ref = torch.softmax(query.double() @ k64.transpose(-1, -2), -1) @ v64
    return {**row, "max_abs_error_vs_float64": float((out.double() - ref).abs().max())}


def main(argv: list[str] | None = None) -> int:
    global GROUP, HEAD_DIM  # the measures read the shape from here (set once per run, before any measure)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_attention_kernel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--kernels", nargs="+", default=["dense"], choices=("dense", "refine", "selection", "selection-int8"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--group", type=int, default=GROUP, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    GROUP, HEAD_DIM = args.group, args.head_dim
    from benchmarks.decode import machine_info

    measures = {"dense": measure, "refine": measure_refine, "selection": measure_selection,
                "selection-int8": measure_selection_int8}
    rows = [measures[kernel](getattr(torch, name), args.context, args.repeats)
            for kernel in args.kernels for name in args.dtypes]
    for r in rows:
        error = f", max error vs float64 {r['max_abs_error_vs_float64']:.1e}" if "max_abs_error_vs_float64" in r else ""
        if "store_kernel_ms" in r:
            error = (f"; over the {r['dtype']} keys {r['store_kernel_ms']:.1f} ms, largest score difference "
                     f"{r['max_abs_score_diff']:.1e}")
        print(f"{r['kernel']} {r['dtype']}: kernel {r['kernel_ms']:.1f} ms ({r['kernel_gb_s']:.1f} GB/s) for 30 calls, "
              f"torch.sum {r['torch_sum_ms']:.1f} ms ({r['torch_sum_gb_s']:.1f} GB/s){error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": "python -m benchmarks.cpu_attention_kernel " + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": machine_info(), "threads": torch.get_num_threads(), "group": GROUP,
                  "head_dim": HEAD_DIM, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
