"""What the first decode step costs to compile, beside what a step then costs.

For each variant (backend options as JSON) a new Python process loads SmolLM2-135M (or the
tiny random model), fills a ``SpeContextCache`` with ``--context`` random KV rows (compile
time does not depend on values), compiles ``model.forward`` with ``backend="specontext"`` and
runs ``--steps`` decode steps; it reports the first step's seconds (dynamo + our pass +
inductor: the compile), the median of the later steps, inductor's phase times
(``torch._dynamo.utils.compile_times``: scheduler, C++ compile) and our region counters.
Each variant runs twice on one inductor cache folder: ``cold`` (a new, empty folder) and
``restart`` (a new process on the folder the cold run filled: what a user's second launch
costs).

    python -m benchmarks.compile_time --variants '{}' '{"regional": false}' --json docs/results/compile_time.json
    python -m benchmarks.compile_time --model tiny --context 64 --steps 3     # smoke test

``--interleaved`` instead compiles every variant in one process and times their steps in
turn (step 1 of each, then step 2 of each, ...): the fair comparison of step times, since two
processes minutes apart on this machine differ by more than the variants do.

    python -m benchmarks.compile_time --interleaved --steps 60 --json docs/results/compile_time_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("bytecode_tracing", "create_aot_dispatcher_function", "compile_fx_inner", "Scheduler.__init__",
          "Scheduler.codegen", "compile_file")


def measure(model_name: str, context: int, batch: int, steps: int, options: dict) -> dict:
    """One process's figures (called in the child; ``TORCHINDUCTOR_CACHE_DIR`` already set)."""
    import torch
    from torch._dynamo.utils import compile_times, counters

    from benchmarks.decode import fill_cache, make_cache, random_model, random_source, tiny_config

    if model_name == "tiny":
        model = random_model(tiny_config())
    else:
        from specontext_compile.models import load_model

        model, _ = load_model(model_name)
    cache = make_cache("specontext", model.config, context + steps + 1)
    fill_cache(cache, random_source(model.config, context), batch)
    forward = torch.compile(model.forward, backend="specontext", options={"budget": 1024, **options})
    token = torch.full((batch, 1), 5)
    seconds = []
    with torch.no_grad():
        for i in range(steps):
            start = time.perf_counter()
            forward(input_ids=token, past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([context + i]))
            seconds.append(time.perf_counter() - start)
    names, values = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, map(float, values)))
    return {
        "first_step_s": round(seconds[0], 2),
        "step_ms_median": round(1000 * statistics.median(seconds[min(3, steps - 1):]), 2),
        "phases_s": {k: round(phases[k], 2) for k in PHASES if k in phases},
        "regions": counters["specontext"]["regions"],
        "regions_compiled": counters["specontext"]["regions_compiled"],
        "path_counts": cache.path_counts(),
    }


def interleaved(model_name: str, context: int, batch: int, steps: int, variants: list[dict]) -> dict:
    """Median step ms per variant, every variant compiled in this process and stepped in turn
    (the first 5 steps after the compiling one are left out)."""
    import torch

    from benchmarks.decode import fill_cache, make_cache, random_model, random_source, tiny_config

    if model_name == "tiny":
        model = random_model(tiny_config())
    else:
        from specontext_compile.models import load_model

        model, _ = load_model(model_name)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(variants))
    source = random_source(model.config, context)
    token = torch.full((batch, 1), 5)
    runs = []
    for options in variants:
        cache = make_cache("specontext", model.config, context + steps + 1)
        fill_cache(cache, source, batch)
        forward = torch.compile(model.forward, backend="specontext", options={"budget": 1024, **options})
        runs.append((forward, cache, []))
    with torch.no_grad():
        for i in range(steps):
            for forward, cache, seconds in runs:
                start = time.perf_counter()
                forward(input_ids=token, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([context + i]))
                seconds.append(time.perf_counter() - start)
    return {"rows": [{"options": options, "first_step_s": round(seconds[0], 2),
                      "step_ms_median": round(1000 * statistics.median(seconds[6:]), 2),
                      "step_ms_p10_p90": [round(1000 * q, 2) for q in statistics.quantiles(seconds[6:], n=10)[::8]]}
                     for options, (_, _, seconds) in zip(variants, runs)]}


def _child(args: argparse.Namespace, options: dict, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    code = ("import json, sys; from benchmarks.compile_time import measure; "
            f"print(json.dumps(measure({args.model!r}, {args.context}, {args.batch}, {args.steps}, "
            f"json.loads(sys.argv[1]))))")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, json.dumps(options)], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent.parent, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"variant {options} failed:\n{done.stderr[-4000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["process_s"] = round(time.perf_counter() - start, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "tiny"))
    parser.add_argument("--context", type=int, default=2048, help="cached tokens before the first step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="decode steps (the first compiles)")
    parser.add_argument("--variants", nargs="+", default=["{}", '{"regional": false}'],
                        help="backend options per variant, as JSON (budget 1024 unless given)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--interleaved", action="store_true",
                        help="one process: compile every variant, then time their steps in turn")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.compile_time " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.interleaved:
        result = {"command": command, "model": args.model, "context": args.context, "batch": args.batch,
                  **interleaved(args.model, args.context, args.batch, args.steps,
                                [json.loads(v) for v in args.variants])}
        for row in result["rows"]:
            print(f"{json.dumps(row['options']):28s} step {row['step_ms_median']:7.1f} ms "
                  f"[{row['step_ms_p10_p90'][0]:.1f}-{row['step_ms_p10_p90'][1]:.1f}]", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    rows = []
    for variant in args.variants:
        options = json.loads(variant)
        with tempfile.TemporaryDirectory(prefix="inductor_cold_") as cache_dir:
            for run in ("cold", "restart"):
                row = {"options": options, "run": run, **_child(args, options, cache_dir)}
                rows.append(row)
                print(f"{json.dumps(options):28s} {run:8s} first step {row['first_step_s']:7.1f} s  "
                      f"step {row['step_ms_median']:7.1f} ms  regions {row['regions']}/{row['regions_compiled']} "
                      f"compiled", flush=True)
    from benchmarks.decode import machine_info

    result = {"command": command, "machine": machine_info(),
              "model": args.model, "context": args.context, "batch": args.batch, "steps": args.steps,
              "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
