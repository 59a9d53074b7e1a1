"""Each request of a ``benchmarks.serving`` run alone (issue 28, target "every request's text
equal to its solo sparse run").

Reads the JSON a ``benchmarks.serving`` run wrote, rebuilds its prompts (the same windows of
real text), and runs ``--check`` of its requests (from ``--start``) one at a time through ``sc.compile`` (the
one-request step, ``SpeContextCache``) with the options the batched engine ran; compares each
request's greedy tokens with the tokens the batched specontext engine gave it, and counts the
gather path of the solo run (every decode step of every layer must have gathered).

    python -m benchmarks.serving_solo --run docs/results/serving_8x4096_3072.json --check 2 --json docs/results/serving_8x4096_3072_solo.json
    python -m benchmarks.serving_solo --run docs/results/serving_8x4096_3072.json --start 2 --check 6 --json docs/results/serving_8x4096_3072_solo.json

The second command adds requests 2-7 to the report the first wrote (one run of each request
takes 6-8 minutes on this quiet 2-core CPU at [4K in, 3K out]: docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .serving import first_divergence, prompts


def solo_options(run_args: dict) -> dict:
    """The options the batched ``specontext`` engine of that run was built with."""
    return {"budget": run_args["budget"], "page_rescue": run_args["page_rescue"],
            "candidates": run_args["candidates"], "inner": "eager" if run_args["inner"] == "eager" else "auto"}


def run_alone(model, prompt: list[int], new_tokens: int) -> tuple[list[int], dict, float]:
    """One prompt through the compiled model: its generated tokens, path counts, seconds."""
    import specontext_compile as sc

    cache = sc.SpeContextCache(model.config, max_cache_len=len(prompt) + new_tokens + 1)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, cache=cache, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist(), cache.path_counts(), time.perf_counter() - start


def _earlier(path: str | None, run: str) -> dict | None:
    """The report already at ``path`` if it checked the same run (its requests are kept)."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (TypeError, FileNotFoundError):
        return None
    if earlier.get("run") != run:
        raise SystemExit(f"{path} reports on {earlier.get('run')}, not {run}: give another --json")
    earlier.setdefault("commands", [earlier.pop("command")] if "command" in earlier else [])
    return earlier


def merged(earlier: dict | None, report: dict) -> dict:
    """``report`` with the requests of an ``earlier`` report of the same run that it did not
    rerun (a rerun request replaces the earlier one), in request order, and the tally."""
    requests, commands = report["requests"], report["commands"]
    if earlier:
        ran = {r["request"] for r in requests}
        requests = sorted([r for r in earlier["requests"] if r["request"] not in ran] + requests,
                          key=lambda r: r["request"])
        commands = earlier["commands"] + commands
    return {**report, "commands": commands, "requests": requests,
            "requests_equal": sum(r["equal"] for r in requests), "checked": len(requests)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="the JSON a benchmarks.serving run wrote (with engine specontext)")
    parser.add_argument("--check", type=int, default=1, help="how many requests to run alone")
    parser.add_argument("--start", type=int, default=0,
                        help="the first request to run (requests start .. start + check - 1); with --json naming a "
                             "report of the same run, its requests are kept and these added")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with open(args.run) as f:
        report = json.load(f)
    if "specontext" not in report.get("tokens", {}):
        parser.error(f"{args.run} holds no tokens of engine specontext: run benchmarks.serving with it first")
    if args.check < 1 or not 0 <= args.start < report["args"]["requests"]:
        parser.error(f"--check must be >= 1 and --start one of the run's {report['args']['requests']} requests "
                     f"(0 .. {report['args']['requests'] - 1}); got --check {args.check} --start {args.start}")

    import specontext_compile as sc
    from specontext_compile.models import load_model

    run_args = report["args"]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(run_args["model"])
    inputs = prompts(tokenizer, run_args["requests"], run_args["input"])[args.start:args.start + args.check]
    options = solo_options(run_args)
    layers = model.config.num_hidden_layers
    earlier = _earlier(args.json, args.run)
    command = " ".join(["python -m benchmarks.serving_solo", *sys.argv[1:]])
    requests = []
    sc.compile(model, **options)
    try:
        for i, prompt in enumerate(inputs, start=args.start):
            tokens, counts, seconds = run_alone(model, prompt, run_args["output"])
            batched = report["tokens"]["specontext"][i]
            requests.append({"request": i, "equal": tokens == batched, "first_divergence": first_divergence(batched, tokens),
                             "seconds": seconds, "path_counts": counts,
                             "every_decode_step_gathered": counts.get("gather_sites") == (run_args["output"] - 1) * layers,
                             "tokens": tokens})
            print(json.dumps({k: v for k, v in requests[-1].items() if k != "tokens"}), file=sys.stderr, flush=True)
            result = merged(earlier, {"commands": [command], "run": args.run, "options": options, "requests": requests})
            if args.json:  # after each request: a run stopped early keeps what it checked
                with open(args.json, "w") as f:
                    f.write(json.dumps(result, indent=1))
    finally:
        sc.restore(model)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1))


if __name__ == "__main__":
    main()
