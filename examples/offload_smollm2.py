"""Measure KV offload on SmolLM2-135M: bytes moved per decode step with and without elastic
loading, the memory model's thresholds, a Chrome trace, and agreement with offload off.

    .venv/bin/python examples/offload_smollm2.py --prompt-file examples/pydoc_prompt.txt \\
        --budget 1024 --new-tokens 48 --json out/offload_smollm2.json \\
        --trace docs/results/offload_trace_smollm2.json

CPU heavy (three prefills of the prompt): run it once. The device tier is emulated
(``device_memory_bytes``) and sized so that ``--offload-at-start`` layers must leave it at
the first decode step; more follow as the output grows if the thresholds are reached.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

import specontext_compile as sc
from specontext_compile.models import load_model
from specontext_compile.report import build_prompt
from specontext_compile.runtime.offload import enable_offload

logger = logging.getLogger("offload_smollm2")


def _decode(forward, cache, ids, steps):
    """Prefill + greedy decode; returns (tokens, per-step seconds)."""
    tokens, times = [], []
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            t0 = time.perf_counter()
            logits = forward(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
            times.append(time.perf_counter() - t0)
    return tokens, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-file", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--candidates", type=float, default=1.0,
                    help="two-stage selection (issue 12): the step prefetches ceil(candidates * budget) tokens")
    ap.add_argument("--page-rescue", type=int, default=0,
                    help="tokens of rescued pages per layer (option page_rescue): loaded on demand from the host tier")
    ap.add_argument("--dense-layers", type=int, nargs="+", default=[], metavar="LAYER",
                    help="option dense_layers: layers kept dense, and so kept on the device (never offloaded)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--offload-at-start", type=int, default=15)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    ids = build_prompt(tokenizer, args.prompt_file.read_text(encoding="utf-8"))
    prompt = ids.shape[1]
    cap = prompt + args.new_tokens + 1
    opts = {"budget": args.budget, "candidates": args.candidates, "page_rescue": args.page_rescue,
            "dense_layers": tuple(args.dense_layers)}
    rows = sc.SpeContextConfig(**opts).buffer_tokens  # an offloaded layer's buffer rows

    off = torch.compile(model.forward, backend="specontext", options=opts)
    ref_tokens, ref_times = _decode(off, sc.SpeContextCache(model.config, max_cache_len=cap), ids, args.new_tokens)
    torch._dynamo.reset()

    results = {"prompt_tokens": prompt, "budget": args.budget, "candidates": args.candidates,
               "page_rescue": args.page_rescue, "dense_layers": list(args.dense_layers), "buffer_rows": rows,
               "new_tokens": args.new_tokens}
    for elastic in (True, False):
        on = torch.compile(model.forward, backend="specontext",
                           options=dict(opts, device_memory_bytes=1 << 40))
        cache = sc.SpeContextCache(model.config, max_cache_len=cap)
        manager = enable_offload(cache, model, 1 << 40, rows, elastic=elastic,
                                 trace_path=str(args.trace) if (args.trace and elastic) else None,
                                 resident_layers=opts["dense_layers"])
        with torch.no_grad():  # prefill, then size the emulated device tier
            logits = on(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        mm = manager.prepare()
        mem = mm.device_bytes(prompt + 1, min(args.offload_at_start, mm.offloadable))
        manager.prepare(mem)
        tokens, times = [], []
        with torch.no_grad():
            for _ in range(args.new_tokens):
                nxt = logits.argmax(-1, keepdim=True)
                tokens.append(int(nxt))
                t0 = time.perf_counter()
                logits = on(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
                times.append(time.perf_counter() - t0)
        steps = manager.stats[1:]  # the first step fills the buffers from empty
        per_step = [s.bytes_elastic for s in steps]
        full = [s.bytes_full_reload for s in steps]
        key = "elastic" if elastic else "full_reload"
        results[key] = {
            "device_memory_bytes": mem,
            "thresholds": manager.summary()["thresholds"],
            "offload_events": manager.offload_events,
            "resident_layers": manager.summary()["resident_layers"],
            "first_step_bytes": manager.stats[0].bytes_elastic,
            "bytes_moved_mean": sum(per_step) / len(per_step),
            "bytes_moved_min": min(per_step), "bytes_moved_max": max(per_step),
            "bytes_full_reload_mean": sum(full) / len(full),
            "rescued_rows_mean": sum(s.rescued_rows for s in steps) / len(steps),
            "ratio_vs_full_reload": sum(per_step) / sum(full),
            "tokens_equal_offload_off": tokens == ref_tokens,
            "decode_ms_median": sorted(times)[len(times) // 2] * 1e3,
            "transfer_backend": manager.summary()["transfer_backend"],
        }
        logger.info("%s: %s", key, results[key])
        manager.close()
        torch._dynamo.reset()
    results["decode_ms_median_offload_off"] = sorted(ref_times)[len(ref_times) // 2] * 1e3
    text = json.dumps(results, indent=1)
    sys.stdout.write(text + "\n")  # the script's result on stdout
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)


if __name__ == "__main__":
    main()
