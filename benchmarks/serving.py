"""Continuous batching, dense against specontext, in one run (issue 28, item 4).

N concurrent requests of ``--input`` tokens of real text (distinct windows of
``pydoc_data.topics``), ``--output`` greedy tokens each, through Hugging Face's
continuous-batching engine (``model.generate_batch``) twice: with Hugging Face's own step
compiled by the same compiler (the strongest dense step we can run: its graph as one graph,
the cache update made traceable as ours is) and with the specontext backend
(``specontext_compile.continuous_batching_config``). Every step call is timed by a wrapper
around the compiled step and classed as decode (every request one token) or not, from the
step's mask; the figures are decode steps only (median, p10-p90), never differences of
``generate_batch`` totals. Also: the bandwidth floor of a decode step (weights + the KV each
engine reads, at the measured copy bandwidth), the tokens of each request in every engine,
and the specontext path counters. Engine ``specontext`` runs the backend's options (the page
rescue on, as by default); ``specontext-p0`` the same without the page rescue.

    python -m benchmarks.serving --requests 8 --input 1024 --output 32 --budget 512 --json out/serving.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from .decode import machine_info, measure_copy_bandwidth, param_bytes, real_text_ids


class StepTimer:
    """Wraps a ``torch.compile`` backend: every call of the compiled step is timed and classed
    (decode: every request of the step has one query token; from the step's mask)."""

    def __init__(self, name: str = "", every: int = 0, recompile_limit: int | None = None):
        self.name, self.every, self.started = name, every, time.perf_counter()
        self.recompile_limit = recompile_limit  # raised in the engine's thread, where the step compiles
        self.decode: list[float] = []
        self.other: list[float] = []
        self.rows: list[int] = []  # requests decoding in each decode step

    def wrap(self, backend):
        from specontext_compile.runtime.paged import SPARSE, classify_step
        from specontext_compile.serving import raise_recompile_limit

        def timed(gm, example_inputs, **kwargs):
            raise_recompile_limit(self.recompile_limit)  # past it torch would run a step untimed
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            mask = next(i for i, name in enumerate(names) if "attention_mask" in name)
            step = backend(gm, example_inputs, **kwargs)

            def call(*args):
                kind, rows = classify_step(args[mask])
                start = time.perf_counter()
                out = step(*args)
                (self.decode if kind == SPARSE else self.other).append(time.perf_counter() - start)
                if kind == SPARSE:
                    self.rows.append(rows)
                    self.progress()
                return out

            return call

        timed.backend = getattr(backend, "backend", None)
        return timed

    def progress(self) -> None:
        """Every ``every`` decode steps, one line on stderr: a run of thousands of steps shows how far it is."""
        if self.every and len(self.decode) % self.every == 0:
            recent = statistics.median(self.decode[-self.every:])
            print(f"{self.name}: {len(self.decode)} decode steps, {len(self.other)} other, "
                  f"{time.perf_counter() - self.started:.0f} s, median of the last {self.every}: "
                  f"{1e3 * recent:.1f} ms", file=sys.stderr, flush=True)

    def summary(self, requests: int) -> dict:
        steps = sorted(self.decode)
        if not steps:
            return {"decode_steps": 0}
        q = statistics.quantiles(steps, n=10) if len(steps) > 1 else [steps[0]] * 9
        median = statistics.median(steps)
        return {"decode_steps": len(steps), "median_ms": 1e3 * median, "p10_ms": 1e3 * q[0], "p90_ms": 1e3 * q[-1],
                "mean_rows_per_decode_step": sum(self.rows) / len(self.rows),
                "decode_tokens_per_s": sum(self.rows) / sum(steps), "other_steps": len(self.other),
                "other_s": sum(self.other), "other_ms": [round(1e3 * t, 1) for t in self.other]}


def inductor(gm, example_inputs, **_):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def eager(gm, example_inputs, **_):
    return gm.forward


def prompts(tokenizer, requests: int, length: int) -> list[list[int]]:
    ids = real_text_ids(tokenizer, requests * length)[0]
    return [ids[i * length:(i + 1) * length].tolist() for i in range(requests)]


def engine_settings(args) -> dict:
    """Static shapes: decode steps pad the query to the request count, every step pads the
    packed KV to the whole cache (one graph for decode steps, one for prefill chunks; or to a
    multiple of ``--kv-padding`` tokens: a graph per padded size, each step reads less padding);
    no safety margin of free blocks, so that all requests run at once."""
    per_request = -(-(args.input + args.output) // args.page) + 1
    blocks = args.requests * per_request + 2
    kv_padding = getattr(args, "kv_padding", None) or blocks * args.page
    return dict(page_size=args.page, num_blocks=blocks, max_batch_tokens=args.max_batch_tokens,
                max_requests_per_batch=args.requests, q_padding_interval_size=args.requests,
                kv_padding_interval_size=kv_padding, auto_switch_to_flash=False,
                safety_margin=0.0)  # every request at once (the default margin ran 8 requests as ~2 waves of 4)


def first_divergence(dense: list[int], ours: list[int]) -> int:
    """The index of the first generated token that differs (the length when none does)."""
    return next((i for i, (a, b) in enumerate(zip(dense, ours)) if a != b), min(len(dense), len(ours)))


def kv_bytes_per_token(config) -> int:
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4  # fp32 keys and values


def memory(args, settings: dict, per_token: int, state: int) -> dict:
    """Bytes per engine: the engine's KV cache (every block, fp32 keys and values; the same
    for every engine: ours keeps the whole KV resident), one request's KV at its last token,
    and the retrieval state ours keeps beside it (``specontext_compile.serving.state_bytes``),
    in all and per request."""
    cache = settings["num_blocks"] * settings["page_size"] * per_token
    return {"kv_cache_bytes": cache, "kv_bytes_per_request": per_token * (args.input + args.output),
            "state_bytes": state, "state_bytes_per_request": state // args.requests,
            "state_share_of_kv_cache": state / cache}


def floor_bytes(args, engine: str, weights: int, per_token: int) -> int:
    """Bytes a decode step must read at the median decode step: the weights, plus the KV of
    every request's context (dense) or of its ``budget`` selected tokens and, with the page
    rescue, the keys of the rescued pages it ranks (half a token's KV bytes each)."""
    context = args.input + args.output // 2  # tokens cached per request at the median decode step
    if engine == "dense":
        return weights + per_token * args.requests * context
    kept = min(args.budget, context)
    rescued = 0 if engine == "specontext-p0" else min(args.page_rescue, context - kept)
    return weights + args.requests * (per_token * kept + per_token // 2 * rescued)


def dense_whole_run_bound(dense: dict, args) -> dict:
    """When dense ran only the first ``--dense-output`` tokens of each request: a lower bound on
    its whole run, seconds. Its measured run (prefill and the first decode steps) plus one step
    per remaining token at the median of the decode steps it ran, which read the shortest KV
    of the run (a dense step reads every cached token: later steps cost at least as much).
    Generated tokens/s over that bound is an upper bound on dense's."""
    remaining = args.output - args.dense_output
    seconds = dense["generate_batch_s"] + remaining * dense["median_ms"] / 1e3
    return {"dense_output": args.dense_output, "whole_run_s_lower_bound": seconds,
            "generated_tokens_per_s_upper_bound": args.requests * args.output / seconds}


def command() -> str:
    return " ".join(["python -m benchmarks.serving", *sys.argv[1:]])


def write(args, report: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1))


def run(args) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    import specontext_compile as sc
    from specontext_compile import serving
    from specontext_compile.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.set_attn_implementation("sdpa")
    inputs = prompts(tokenizer, args.requests, args.input)
    gen = {n: GenerationConfig(max_new_tokens=args.dense_output if n == "dense" and args.dense_output else args.output,
                               do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id or 0)
           for n in args.engines}
    settings = engine_settings(args)
    compiler = {"inductor": inductor, "eager": eager}[args.inner]
    serving._traceable_cache_update()  # the dense step as one graph too, as ours is
    results = {}
    tokens = {}
    for name in args.engines:
        torch._dynamo.reset()
        timer = StepTimer(name, args.progress_every, serving._recompile_limit(settings))
        if name == "dense":
            compile_config = CompileConfig(backend=timer.wrap(compiler), mode="default", fullgraph=False, dynamic=False)
            cb = ContinuousBatchingConfig(varlen_compile_config=compile_config, **settings)
        else:
            options = {"budget": args.budget, "page_rescue": 0 if name == "specontext-p0" else args.page_rescue,
                       "candidates": args.candidates, "inner": "eager" if args.inner == "eager" else "auto"}
            cb = sc.continuous_batching_config(model, options, **settings)
            cb.varlen_compile_config.backend = timer.wrap(cb.varlen_compile_config.backend)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate_batch(inputs=inputs, generation_config=gen[name], continuous_batching_config=cb)
        wall = time.perf_counter() - start
        errors = [o.error for o in out.values() if o.error is not None]
        if errors:
            raise RuntimeError(f"{name}: {errors[0]}")
        tokens[name] = [out[f"req_{i}"].generated_tokens for i in range(args.requests)]
        results[name] = {**timer.summary(args.requests), "generate_batch_s": wall}
        if name != "dense":
            results[name]["path_counts"] = serving.path_counts(cb)
            results[name]["state_bytes"] = serving.state_bytes(cb)
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
        write(args, {"command": command(), "args": vars(args), "partial": True, "results": results, "tokens": tokens})  # hours of work survive a crash
    bandwidth = measure_copy_bandwidth()
    weights = param_bytes(model)
    per_token = kv_bytes_per_token(model.config)
    for name in results:
        results[name]["floor_ms"] = 1e3 * floor_bytes(args, name, weights, per_token) / bandwidth
        results[name]["memory"] = memory(args, settings, per_token, results[name].get("state_bytes", 0))
    if args.dense_output and "dense" in results:
        results["dense"]["whole_run"] = dense_whole_run_bound(results["dense"], args)
    for name in list(results) if "dense" in results and results["dense"].get("median_ms") else ():
        if name == "dense":
            continue
        results[name]["speedup_decode_step"] = results["dense"]["median_ms"] / results[name]["median_ms"]
        results[name]["requests_with_dense_tokens"] = sum(a == b[:len(a)] for a, b in zip(tokens["dense"], tokens[name]))
        if "whole_run" in results["dense"]:  # ours measured whole, dense bounded: a lower bound on the ratio
            ours = args.requests * args.output / results[name]["generate_batch_s"]
            results[name]["speedup_whole_run_lower_bound"] = ours / results["dense"]["whole_run"][
                "generated_tokens_per_s_upper_bound"]
        results[name]["first_divergence"] = [first_divergence(a, b) for a, b in zip(tokens["dense"], tokens[name])]
        if name == "specontext":  # where the runs before 2026-12-03 wrote them
            for key in ("speedup_decode_step", "requests_with_dense_tokens", "first_divergence"):
                results[key] = results[name][key]
    return {"command": command(), "args": vars(args), "machine": machine_info(), "copy_bandwidth_gbs": bandwidth / 1e9, "weight_bytes": weights,
            "engine": settings, "results": results, "tokens": tokens}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--candidates", type=float, default=1.0,
                        help="option candidates: > 1 refines the selection per layer (docs/serving.md)")
    parser.add_argument("--page-rescue", type=int, default=None,
                        help="option page_rescue of the specontext engine (default: the option's default); "
                             "engine specontext-p0 runs without it")
    parser.add_argument("--page", type=int, default=64, help="the engine's page (block) size in tokens")
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--inner", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--engines", nargs="+", default=["dense", "specontext"],
                        choices=("dense", "specontext", "specontext-p0"))
    parser.add_argument("--kv-padding", type=int, default=None,
                        help="pad the packed KV of each step to a multiple of this many tokens (default: the whole "
                             "cache, one graph per step kind)")
    parser.add_argument("--dense-output", type=int, default=None,
                        help="dense generates only this many tokens per request (the same prompts): its whole run "
                             "is then bounded from below from the steps it ran (results.dense.whole_run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--progress-every", type=int, default=128,
                        help="print a progress line every this many decode steps (0: never)")
    args = parser.parse_args(argv)
    if args.page_rescue is None:  # the option's default at this budget
        from specontext_compile.config import SpeContextConfig

        args.page_rescue = SpeContextConfig.from_options({"budget": args.budget}).selection.page_rescue
    if args.dense_output is not None and not 0 < args.dense_output <= args.output:
        parser.error(f"--dense-output {args.dense_output}: give 1 to --output ({args.output}) tokens")
    report = run(args)
    write(args, report)
    print(json.dumps(report["results"], indent=1))


if __name__ == "__main__":
    main()
