"""Where the plugin's decode step goes inside vLLM: the selection and the attention forwards.

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on SmolLM2-135M with the plugin,
configured as ``benchmarks.vllm_serving``'s (block size 32), 8 requests of 7680 prompt tokens
(its prompts), 40 greedy tokens; the
plugin's ``_select`` (once per step) and every layer's attention ``forward`` timed with
``time.perf_counter``; the medians over the last 30 decode steps. Run in vLLM's venv
(``bash scripts/vllm_venv.sh``), once per option value, e.g. the selection over the int8 keys
against vLLM's cache (issue 54):

    .venv-vllm/bin/python -m benchmarks.vllm_step_parts --selection-keys int8 store --dtypes fp32 bf16 --json docs/results/<name>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.vllm_serving import DTYPES, MODEL_DIR, _prompts, write_rows

ROOT = Path(__file__).resolve().parent.parent
STEPS, LAYERS = 30, 30


def _worker(keys: str, dtype: str, requests: int, tokens: int) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from specontext_vllm import backend
    from vllm import LLM, SamplingParams

    spans = {"select": [], "forward": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spans[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    backend.SpeContextImpl._select = timed("select", backend.SpeContextImpl._select)
    backend.SpeContextImpl.forward = timed("forward", backend.SpeContextImpl.forward)
    # the engine of benchmarks.vllm_serving's worker (block size 32, no prefix caching)
    llm = LLM(model=str(MODEL_DIR), dtype=DTYPES[dtype], enforce_eager=True, max_model_len=tokens + STEPS + 10,
              block_size=32, max_num_seqs=requests, gpu_memory_utilization=0.3, enable_prefix_caching=False,
              additional_config={"specontext": {"budget": 1024, "selection_keys": keys}})
    llm.generate([{"prompt_token_ids": p} for p in _prompts(requests, tokens)],
                 SamplingParams(max_tokens=STEPS + 10, temperature=0.0))
    forwards = spans["forward"][-STEPS * LAYERS:]
    per_step = [sum(forwards[i * LAYERS:(i + 1) * LAYERS]) for i in range(STEPS)]
    return {"selection_keys": keys, "dtype": dtype, "requests": requests, "input": tokens,
            "select_ms_p50": round(statistics.median(spans["select"][-STEPS:]) * 1e3, 2),
            "attention_forwards_ms_per_step_p50": round(statistics.median(per_step) * 1e3, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_step_parts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--selection-keys", nargs="+", default=["int8", "store"], choices=["int8", "store"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input", type=int, default=7680)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(**json.loads(args.worker))))
        return 0
    if not MODEL_DIR.exists():
        raise SystemExit(f"{MODEL_DIR} is missing: run python -m benchmarks.vllm_serving once (it exports the model)")
    rows = []
    for dtype in args.dtypes:
        for keys in args.selection_keys:  # one fresh process each
            job = json.dumps({"keys": keys, "dtype": dtype, "requests": args.requests, "tokens": args.input})
            done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_step_parts", "--worker", job], cwd=ROOT,
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{keys} {dtype} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]))
    if args.json:
        write_rows(args.json, "benchmarks.vllm_step_parts", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
