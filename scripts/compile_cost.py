"""What one decode-graph compile costs: a tiny random Llama (3 layers, 6 query / 2 KV heads)
prefilled with 40 tokens, then 3 decode steps through the backend, in a new inductor cache
folder (cold) or a given one (warm). docs/testing.md quotes it.

Usage::

    python scripts/compile_cost.py                       # default options, cold
    python scripts/compile_cost.py --options '{"page_rescue": 0}'
    python scripts/compile_cost.py --cache-dir /tmp/ic   # run twice: cold, then warm

Prints JSON: wall seconds of prefill + 3 steps, inductor's ``compile_fx_inner`` and
``compile_file`` seconds (from ``torch._dynamo.utils.compile_times``), the number of distinct
C++ kernel sources in the cache folder, and the compiled step's path counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default="{}", help="backend options as JSON (budget 8 unless given)")
    parser.add_argument("--cache-dir", help="inductor cache folder (default: a new, empty one)")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="inductor_cold_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch reads it
    import torch
    from torch._dynamo.utils import compile_times

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _tiny import compiled_steps, tiny_llama

    options = {"budget": 8, **json.loads(args.options)}
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    _, cache = compiled_steps(tiny_llama(), ids, 3, **options)
    wall = time.perf_counter() - start
    headers, values = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(headers, map(float, values)))
    print(json.dumps({
        "options": options, "cache_dir": cache_dir, "wall_s": round(wall, 1),
        "compile_fx_inner_s": round(phases.get("compile_fx_inner", 0.0), 1),
        "compile_file_s": round(phases.get("compile_file", 0.0), 1),
        "cpp_kernels_in_cache": len(list(Path(cache_dir).rglob("*.main.cpp"))),
        "path_counts": cache.path_counts(),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
