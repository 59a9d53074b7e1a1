"""Our backend on the far-context tasks the kvpress peer ran, same tokens, same scoring.

:mod:`benchmarks.kvpress_peer` (its own venv) measured NVIDIA kvpress's presses on the tasks
of :mod:`benchmarks.far_context`: the *plain* continuation of the first ``N = context - 64``
tokens of ``pydoc_data.topics``, and a *copy* task per depth (the question quotes the first 12
words of a passage at depth 0.1 / 0.5 / 0.9 of the context; the continuation is that passage's
next tokens), in setting **A** (question inside the prompt) and **B** (question fed after the
prompt). This script runs the same tasks through ``torch.compile(model.forward,
backend="specontext", options=...)``: dense prefill of the prompt, then every fed token is one
sparse decode step (so in setting B the question itself is decoded sparsely). Per task,
setting and configuration (budget x candidates), against one dense run (Hugging Face SDPA,
``DynamicCache``, every fed token in one forward, as the kvpress peer's dense reference):

* **agreement**: share of the ``steps`` scored positions whose argmax equals dense's;
* **nll_delta**: mean NLL (nats/token) of the true continuation minus dense's;
* **accuracy**: argmax equal to the true continuation (dense's own accuracy says whether the
  task is solvable at all);
* **path counts** (``SpeContextCache.path_counts()``): which path produced the numbers.

The JSON keeps per task the token hashes of :meth:`FarContextTask.describe` and dense's
argmax, so the kvpress JSON (``docs/results/fidelity_kvpress_8k.json``) can be checked for the same
tokens: ``same_dense_argmax`` counts the positions where our dense argmax equals the one the
kvpress run recorded (transformers 5.24 here, 5.2 there).

Run (about 1 minute per task and configuration at 8K on 2 CPU cores, plus compilation)::

    .venv/bin/python -m benchmarks.far_context_backend --context 8192 --steps 128 \\
        --budgets 1024 --candidates 1 4 --out docs/results/fidelity_far_context_backend_8k.json

An existing ``--out`` of the same context and steps is resumed: its configurations are kept
(a run of the same configuration replaces them) and ``commands`` lists every run.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import specontext_compile as sc
from benchmarks.far_context import FarContextTask, build_tasks, decode_inputs
from specontext_compile.models import load_model

__all__ = ["dense_logits", "scored", "side_by_side", "sparse_logits"]

SETTINGS = ("A", "B")


def scored(logits: torch.Tensor, task: FarContextTask, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax int64 [steps], NLL float64 [steps])`` of the scored rows of ``logits``
    ``[fed, vocab]``: rows ``first .. first + steps`` predict ``continuation[1:]``."""
    rows = logits[first : first + task.steps].double()
    return rows.argmax(-1), -torch.log_softmax(rows, -1).gather(1, task.continuation[1:, None])[:, 0]


def dense_logits(model, prompt: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """``[fed, vocab]`` logits of Hugging Face's dense model (prefill, then ``fed`` in one forward)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[None], cache=cache, use_cache=True)
        return model(input_ids=fed[None], cache=cache, use_cache=True).logits[0].float()


def sparse_logits(forward, config, prompt: torch.Tensor, fed: torch.Tensor, capacity: int
                  ) -> tuple[torch.Tensor, dict]:
    """``([fed, vocab], path counts)``: dense prefill of ``prompt`` through the compiled
    ``forward``, then one decode step per token of ``fed`` in a ``SpeContextCache`` of
    ``capacity`` slots (the same for every task, so the decode graph compiles once)."""
    cache = sc.SpeContextCache(config, max_cache_len=capacity)
    rows = []
    with torch.no_grad():
        forward(input_ids=prompt[None], cache=cache, use_cache=True)
        for i in range(fed.numel()):
            rows.append(forward(input_ids=fed[None, i : i + 1], cache=cache, use_cache=True).logits[0, -1].float())
    return torch.stack(rows), cache.path_counts()


def _kvpress_dense(path: Path | None, context: int, steps: int) -> dict:
    """The kvpress run's dense results when it ran the same context and steps, else {}."""
    if path is None or not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data.get("dense", {}) if (data.get("context"), data.get("steps")) == (context, steps) else {}


PEERS = ("kvzip", "snapkv", "tova", "expected_attention", "streaming_llm")


def side_by_side(ours: dict, theirs: dict, budget: int, peers: tuple[str, ...] = PEERS) -> str:
    """Markdown table, one row per (setting, task) both runs hold: dense accuracy, then
    ``agreement / NLL delta`` of each of our configurations at ``budget`` and of each kvpress
    press at the same kept tokens per KV head (``-``: not run)."""
    configs = sorted({k for by_task in ours["results"].values() for cells in by_task.values() for k in cells
                      if k.startswith(f"b{budget}_")})
    head = ["setting", "task", "dense accuracy"] + [f"ours {c}" for c in configs] + [f"kvpress {p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting, by_task in ours["results"].items():
        for name, cells in by_task.items():
            dense = ours["dense"][setting][name]["accuracy"]
            row = [setting, name, f"{dense:.3f}"]
            row += [f"{cells[c]['agreement']:.3f} / {cells[c]['nll_delta']:+.2f}" if c in cells else "-" for c in configs]
            press = theirs.get("results", {}).get(setting, {}).get(name, {})
            for p in peers:
                cell = press.get(p, {}).get(str(budget))
                row.append(f"{cell['agreement']:.3f} / {cell['nll_delta']:+.2f}" if cell else "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024])
    parser.add_argument("--candidates", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--page-rescue", type=int, default=None,
                        help="option page_rescue for every configuration (default: the backend's, 2 x budget)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--kvpress-json", type=Path, default=Path("docs/results/fidelity_kvpress_8k.json"),
                        help="the kvpress peer's JSON, to check that both ran the same tokens")
    parser.add_argument("--render", type=int, default=None, metavar="BUDGET",
                        help="only print the side-by-side table of --out and --kvpress-json at BUDGET")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.render is not None:
        ours = json.loads(args.out.read_text())
        theirs = json.loads(args.kvpress_json.read_text()) if args.kvpress_json.exists() else {}
        if (theirs.get("context"), theirs.get("steps")) != (ours["context"], ours["steps"]):
            theirs = {}  # another protocol: no peer columns
        print(side_by_side(ours, theirs, args.render))
        return
    model, tok = load_model("smollm2-135m")
    tasks = build_tasks(tok, args.context, args.steps)
    capacity = args.context + args.steps + 128  # prompt + question + fed tokens, every task
    theirs = _kvpress_dense(args.kvpress_json, args.context, args.steps)
    command = "python -m benchmarks.far_context_backend " + shlex.join(sys.argv[1:])
    result = {"command": command, "commands": [command],
              "context": args.context, "steps": args.steps, "tasks": [t.describe() for t in tasks],
              "dense": {}, "results": {}}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if (previous.get("context"), previous.get("steps")) == (args.context, args.steps):
        # resume: keep the configurations an earlier run measured on the same protocol
        result["results"] = previous.get("results", {})
        result["commands"] = previous.get("commands", [previous.get("command")]) + [command]
    runs = [(s, t) for s in args.settings for t in tasks if s == args.settings[0] or t.kind == "copy"]
    inputs = {}
    for setting, task in tqdm(runs, desc="dense"):
        setting = "plain" if task.kind == "plain" else setting
        prompt, fed, first = decode_inputs(task, setting if setting != "plain" else "A")
        argmax, nll = scored(dense_logits(model, prompt, fed), task, first)
        recorded = theirs.get(setting, {}).get(task.name, {}).get("argmax")
        result["dense"].setdefault(setting, {})[task.name] = {
            "nll": float(nll.mean()), "accuracy": float((argmax == task.continuation[1:]).double().mean()),
            "argmax": argmax.tolist(),
            "same_dense_argmax": (sum(a == b for a, b in zip(argmax.tolist(), recorded)) if recorded else None)}
        inputs[(setting, task.name)] = (task, prompt, fed, first, argmax, nll)
    for budget in args.budgets:
        for c in args.candidates:
            torch._dynamo.reset()
            options = {"budget": budget, "candidates": c, "page_rescue": args.page_rescue}
            rescue = sc.SpeContextConfig.from_options(options).page_rescue  # the default resolved
            forward = torch.compile(model.forward, backend="specontext", options=options)
            for (setting, name), (task, prompt, fed, first, d_arg, d_nll) in tqdm(inputs.items(), desc=str(options)):
                start = time.perf_counter()
                logits, paths = sparse_logits(forward, model.config, prompt, fed, capacity)
                argmax, nll = scored(logits, task, first)
                key = f"b{budget}_c{c:g}" + (f"_r{rescue}" if rescue else "")  # no suffix: no rescue
                result["results"].setdefault(setting, {}).setdefault(name, {})[key] = {
                    "budget": budget, "candidates": c if math.isfinite(c) else "inf", "page_rescue": rescue,
                    "agreement": float((argmax == d_arg).double().mean()),
                    "nll_delta": float((nll - d_nll).mean()),
                    "accuracy": float((argmax == task.continuation[1:]).double().mean()),
                    "paths": paths, "seconds": round(time.perf_counter() - start, 1)}
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    for setting, by_task in result["results"].items():
        for name, cells in by_task.items():
            line = "  ".join(f"{k}: {v['agreement']:.3f} / {v['nll_delta']:+.2f}" for k, v in cells.items())
            print(f"{setting:5s} {name:9s} {line}", flush=True)


if __name__ == "__main__":
    main()
