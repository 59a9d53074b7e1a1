"""The offloaded decode step against the resident one: same tokens, same logits, step time of each.

SmolLM2-135M (real weights, the first ``--context`` tokens of ``pydoc_data.topics``), the
backend's default options at ``--budget``, compiled twice in one process: resident, and with
KV offload (``device_memory_bytes``; the device tier is sized after prefill so that
``--offloaded`` layers leave the device at the first decode step, more as the output grows
if the tier is tight). Both decode the same greedy continuation, their steps interleaved
(step i of one, then step i of the other: the machine's drift hits both alike). Reports the
largest logit difference over every decode step (0 = bit-identical), whether the tokens
agree, the median step time of each (a plain decode loop, after ``--warmup`` steps that
include the compile), the compile time, and the offload manager's summary (rows moved).
On CPU the device tier is emulated: an "offloaded" layer reads a separate buffer through its
slot map, so the time difference is the cost of the row moves and the map, not of a bus.

    python -m benchmarks.offload_step --context 4096 --steps 20 --json docs/results/offload_step_smollm2.json

``--profile N`` then runs N more steps of each under ``torch.profiler`` and reports the ops
with the most self CPU time per step; ``--inline-copies`` runs the offload copies on the
calling thread instead of the CPU worker (:class:`~specontext_compile.runtime.streams.CopyStream`
``inline``), to see what the worker costs on a machine without a spare core:

    python -m benchmarks.offload_step --context 4096 --steps 12 --profile 3 --json docs/results/offload_step_profile.json
    python -m benchmarks.offload_step --context 4096 --steps 12 --profile 3 --inline-copies \
        --json docs/results/offload_step_profile_inline.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def _decode(forward, cache, first, steps):
    """Generator: one greedy decode step per ``next()``: ``(logits [batch, vocab], seconds)``."""
    token = first
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            logits = forward(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            seconds = time.perf_counter() - start
            token = logits.argmax(-1, keepdim=True)
            yield logits, seconds


def _profile(steps, count: int, top: int = 12) -> list[dict]:
    """``count`` more steps of ``steps`` under ``torch.profiler``: the ``top`` ops by self CPU
    time, in ms and calls per step."""
    with torch.profiler.profile() as prof:
        for _ in range(count):
            next(steps)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / count, 2),
             "calls_per_step": e.count / count} for e in rows]


def run(context: int, steps: int, warmup: int, budget: int, offloaded: int, profile: int = 0,
        inline_copies: bool = False) -> dict:
    import specontext_compile as sc
    from benchmarks.decode import real_text_ids
    from specontext_compile.models import load_model
    from specontext_compile.runtime.offload import enable_offload

    model, tokenizer = load_model("smollm2-135m")
    ids = real_text_ids(tokenizer, context)
    options = {"budget": budget}
    capacity = context + steps + warmup + profile + 1
    runs = {}
    for name in ("resident", "offloaded"):
        extra = {"device_memory_bytes": 1 << 40} if name == "offloaded" else {}
        forward = torch.compile(model.forward, backend="specontext", options={**options, **extra})
        cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
        manager = None
        if extra:
            manager = enable_offload(cache, model, 1 << 40, sc.SpeContextConfig(**options).buffer_tokens,
                                     inline_copies=inline_copies)
        with torch.no_grad():
            first = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        if manager is not None:
            mm = manager.prepare()
            manager.prepare(mm.device_bytes(context + 1, offloaded))
        runs[name] = {"steps": _decode(forward, cache, first, steps + warmup + profile), "manager": manager,
                      "logits": [], "seconds": []}
    for _ in range(steps + warmup):  # interleaved
        for r in runs.values():
            logits, seconds = next(r["steps"])
            r["logits"].append(logits)
            r["seconds"].append(seconds)
    profiles = {name: _profile(r["steps"], profile) for name, r in runs.items()} if profile else None
    res, off = runs["resident"], runs["offloaded"]
    diff = max(float((a - b).abs().max()) for a, b in zip(res["logits"], off["logits"]))
    same_tokens = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(res["logits"], off["logits"]))
    row = lambda r: {"first_step_s": r["seconds"][0],  # noqa: E731
                     "median_step_ms": 1e3 * statistics.median(r["seconds"][warmup:]),
                     "step_ms": [round(1e3 * s, 2) for s in r["seconds"][warmup:]]}
    manager = off["manager"]
    return {
        "command": "python -m benchmarks.offload_step " + " ".join(
            f"--{k} {v}" for k, v in dict(context=context, steps=steps, warmup=warmup, budget=budget,
                                          offloaded=offloaded, profile=profile).items())
        + (" --inline-copies" if inline_copies else ""),
        "model": "smollm2-135m", "dtype": "float32", "batch": 1, "options": options,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "max_abs_logit_diff": diff, "bit_identical": diff == 0.0, "same_tokens": same_tokens,
        "resident": row(res), "offloaded": row(off),
        "offloaded_layers": manager.offloaded,
        "offload": {k: v for k, v in manager.summary().items() if k != "thresholds"},
        "profile_top_ops": profiles,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (the compile)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--offloaded", type=int, default=30, help="layers offloaded at the first decode step")
    parser.add_argument("--profile", type=int, default=0, help="then this many steps of each under torch.profiler")
    parser.add_argument("--inline-copies", action="store_true", help="offload copies on the calling thread")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args.context, args.steps, args.warmup, args.budget, args.offloaded, args.profile,
                 args.inline_copies)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: result[k] for k in ("max_abs_logit_diff", "same_tokens", "offloaded_layers")}))
    print(f"resident {result['resident']['median_step_ms']:.1f} ms/step, "
          f"offloaded {result['offloaded']['median_step_ms']:.1f} ms/step")
    for name, rows in (result["profile_top_ops"] or {}).items():
        print(f"{name}: " + "; ".join(f"{r['op']} {r['self_cpu_ms_per_step']} ms x{r['calls_per_step']:g}" for r in rows))


if __name__ == "__main__":
    main()
