"""The vLLM plugin's refinement kernel alone, on one rescuing layer's shape (issue 54).

Synthetic caches in vLLM's vector-path packing (keys transposed, values in rows), one per
layer so that each call reads from memory: ``--rows`` decode rows of ``--context`` tokens,
SmolLM2's heads (3 KV heads, 3 query heads each, head_dim 64), block size 32; each row's
candidates per KV head are the shared selection's ``--budget`` tokens in blocks (sink block,
current block, random others) and ``--rescue`` tokens of rescued blocks, refined to
``--budget``. Times :func:`specontext_vllm.refine.refine_attend` (the C++ kernel) and
:func:`~specontext_vllm.refine.refine_torch` over the same inputs, median of ``--calls``
calls rotating over the layers, and the bytes the kernel must read (the candidates' keys and
the kept tokens' values). Run in vLLM's venv::

    .venv-vllm/bin/python -m benchmarks.vllm_refine_kernel --json docs/results/vllm_refine_kernel_2026-12-07_epyc.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.vllm_serving import _copy_bandwidth
from specontext_vllm.layout import FORMS, BlockLayout
from specontext_vllm.refine import forced_counts, refine_attend, refine_torch
from specontext_vllm.selection import with_blocks

KV, GROUPS, HEAD_DIM, BLOCK = 3, 3, 64, 32


def _layout() -> BlockLayout:
    t, j = torch.arange(BLOCK).view(-1, 1), torch.arange(HEAD_DIM).view(1, -1)
    offsets = [FORMS[f](t, j, BLOCK, HEAD_DIM).expand(BLOCK, HEAD_DIM) for f in ("transposed", "rows")]
    return BlockLayout(BLOCK, HEAD_DIM, "transposed", "rows", *offsets)


def _inputs(args, gen: torch.Generator):
    per_row = -(-(args.context + 1) // BLOCK)
    caches = [torch.randn(args.rows * per_row, KV, BLOCK, 2 * HEAD_DIM, generator=gen, dtype=torch.float32)
              for _ in range(args.layers)]
    table = torch.arange(args.rows * per_row, dtype=torch.int32).view(args.rows, per_row)
    lengths = torch.full((args.rows,), args.context + 1)
    last = args.context // BLOCK
    picks = (args.budget + args.rescue) // BLOCK - 2  # besides the sink and the current block
    logical = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(last - 1, generator=gen)[:picks] + 1,
                                      torch.tensor([last])]) for _ in range(args.rows * KV)])
    selection = with_blocks(logical.view(args.rows, KV, -1), table, lengths, BLOCK, torch.tensor(0), per_row)
    query = torch.randn(args.rows, KV * GROUPS, HEAD_DIM, generator=gen)
    return caches, table, lengths, selection, query


def _median_ms(call, calls: int) -> float:
    times = []
    for i in range(calls):
        start = time.perf_counter()
        call(i)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_refine_kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=7744)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rescue", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4, help="caches rotated over (each call reads from memory)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    caches, table, lengths, selection, query = _inputs(args, torch.Generator().manual_seed(0))
    layout, scale = _layout(), HEAD_DIM**-0.5
    sinks, recent = forced_counts(args.budget, 4, 64)
    kernel = lambda i: refine_attend(layout, caches[i % args.layers], table, selection, query, scale, lengths,  # noqa: E731
                                     args.budget, sinks, recent)
    q = (query * scale).view(args.rows, KV, GROUPS, HEAD_DIM)
    torch_path = lambda i: refine_torch(layout, caches[i % args.layers], table, selection, q, lengths,  # noqa: E731
                                        args.budget, sinks, recent)
    kernel(0)  # builds the kernel
    torch.testing.assert_close(kernel(0).view_as(q), torch_path(0), rtol=0, atol=1e-4)
    candidates = int(selection.seq_lens.sum())
    read = (candidates + args.rows * KV * args.budget) * HEAD_DIM * 4  # candidates' keys, kept values
    result = {"rows": args.rows, "context": args.context, "budget": args.budget, "rescue": args.rescue,
              "candidates_per_unit": candidates // (args.rows * KV), "threads": torch.get_num_threads(),
              "kernel_ms": _median_ms(kernel, args.calls), "torch_ms": _median_ms(torch_path, max(args.calls // 10, 5)),
              "bytes_read": read, "command": "python -m benchmarks.vllm_refine_kernel " + " ".join(
                  sys.argv[1:] if argv is None else argv)}
    result["kernel_gb_per_s"] = read / result["kernel_ms"] / 1e6
    result["copy_gb_per_s"] = _copy_bandwidth() / 1e9  # read + write, as benchmarks.vllm_serving measures it
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
