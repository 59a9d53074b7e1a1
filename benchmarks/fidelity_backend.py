"""Fidelity of the *shipped* backend: teacher-forced agreement and NLL of ``backend="specontext"``.

The policy harness (:mod:`benchmarks.fidelity_decode`) re-implements each peer inside an
attention hook; this script measures our own method by running the real thing: the model
compiled with ``backend="specontext"`` (inductor-compiled decode step, the selection node, the
per-layer refinement, the fidelity guard) over the same protocol and text as the harness —
the first ``context`` tokens of ``pydoc_data.topics`` as the prompt (dense prefill), then
``steps`` teacher-forced decode steps feeding the true next tokens. Per configuration
(budget x candidates x min_coverage), against one dense run (Hugging Face SDPA):

* **agreement**: share of steps whose argmax equals the dense run's;
* **nll_delta**: mean NLL (nats/token) of the true next token minus the dense run's;
* **path counts**: ``SpeContextCache.path_counts()`` after the run (steps, sparse/gather
  sites, guard fallbacks) — which path produced the numbers.

``--dtype bfloat16`` runs the model, its KV and the dense reference in bf16 (the agreement is
then against bf16 dense decoding).

Run (about 2 minutes per configuration at 8K on 2 CPU cores, most of it compiling)::

    .venv/bin/python -m benchmarks.fidelity_backend --context 8192 --steps 256 \\
        --budgets 256 512 1024 2048 --candidates 1 2 4 --out docs/results/fidelity_backend_8k.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import logging
import time
from pathlib import Path

import pydoc_data.topics
import torch
from tqdm.auto import tqdm

import specontext_compile as sc
from specontext_compile.models import load_model
from specontext_compile.runtime.torch_private import counters

from benchmarks.kv_int8 import int8_kv_store

logger = logging.getLogger(__name__)

__all__ = ["dense_run", "harness_ids", "sparse_run", "teacher_forced"]


def harness_ids(tokenizer) -> torch.Tensor:
    """``[1, tokens]`` int64: the fidelity harness's text (every ``pydoc_data.topics`` entry,
    sorted by key, joined by blank lines), tokenized without a chat template."""
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return tokenizer(text, return_tensors="pt").input_ids


def teacher_forced(forward, cache, ids: torch.Tensor, context: int, steps: int, desc: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill ``ids[:, :context]`` then feed ``ids[:, context + i]`` for ``i < steps``.

    Returns ``(argmax, nll, margin)``: int64 ``[steps]`` greedy token after each fed token,
    float64 ``[steps]`` NLL (nats) of the true next token ``ids[:, context + i + 1]``, and
    float64 ``[steps]`` the greedy token's lead over the runner-up (log-probability gap,
    nats: near 0 = a near tie, which any change of the logits may flip)."""
    argmax = torch.zeros(steps, dtype=torch.long)
    nll = torch.zeros(steps, dtype=torch.float64)
    margin = torch.zeros(steps, dtype=torch.float64)
    with torch.no_grad():
        forward(input_ids=ids[:, :context], cache=cache, use_cache=True)
        for i in tqdm(range(steps), desc=desc, leave=False):
            logits = forward(input_ids=ids[:, context + i : context + i + 1], cache=cache,
                             use_cache=True).logits[0, -1].double()
            argmax[i] = logits.argmax()
            logp = torch.log_softmax(logits, -1)
            nll[i] = -logp[int(ids[0, context + i + 1])]
            top = logp.topk(2).values
            margin[i] = top[0] - top[1]
    return argmax, nll, margin


def dense_run(model, ids: torch.Tensor, context: int, steps: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense reference: eager Hugging Face decoding (SDPA) with a ``DynamicCache``."""
    from transformers import DynamicCache

    return teacher_forced(model.forward, DynamicCache(config=model.config), ids, context, steps, "dense")


def sparse_run(model, ids: torch.Tensor, context: int, steps: int, kv_store: str = "model", **options) -> dict:
    """One backend configuration: compile, run, read the path counters, restore.
    ``kv_store="int8"``: an 8-bit KV store, emulated (:mod:`benchmarks.kv_int8`)."""
    torch._dynamo.reset()
    writes = int8_kv_store() if kv_store == "int8" else contextlib.nullcontext()
    with writes:
        forward = torch.compile(model.forward, backend="specontext", options=options)
        cache = sc.SpeContextCache(model.config, max_cache_len=context + steps + 1,
                                   selection_keys=sc.SpeContextConfig.from_options(options).selection_keys,
                                   retrieval_layers=options.get("retrieval_layers"))
        start = time.perf_counter()
        int8_calls = counters["specontext"]["cpu_kernel_selection_int8_calls"]
        argmax, nll, _ = teacher_forced(forward, cache, ids, context, steps, f"specontext {options}")
    paths = {**cache.path_counts(),
             "int8_selection_calls": counters["specontext"]["cpu_kernel_selection_int8_calls"] - int8_calls}
    return {"argmax": argmax, "nll": nll, "paths": paths, "seconds": time.perf_counter() - start}


NEAR_TIE_NATS = (0.1, 0.5, 1.0)


def _lost_steps(argmax: torch.Tensor, dense_argmax: torch.Tensor, dense_margin: torch.Tensor) -> dict:
    """The steps whose greedy token differs from dense, with dense's own margin there (nats),
    and how many of them were dense near ties (margin below each of :data:`NEAR_TIE_NATS`)."""
    lost = (argmax != dense_argmax).nonzero().flatten()
    margins = dense_margin[lost]
    return {"lost_steps": lost.tolist(), "lost_dense_margins": [round(float(m), 4) for m in margins],
            "lost_near_ties": {f"margin<{t:g}": int((margins < t).sum()) for t in NEAR_TIE_NATS}}


def _dense(model, ids: torch.Tensor, context: int, steps: int, cache: Path | None):
    """:func:`dense_run`, or its saved result from ``cache`` when it was made for the same
    tokens (``ids[:, :context + steps + 1]``) and model (parameter count, dtype); else the dense run
    is made again and the file rewritten (logged)."""
    key = {"context": context, "steps": steps, "ids": ids[:, : context + steps + 1].clone(),
           "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype)}
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=True)
        if all(k in saved and (torch.equal(saved[k], v) if isinstance(v, torch.Tensor) else saved[k] == v)
               for k, v in key.items()):
            logger.info("dense reference from %s", cache)
            return saved["argmax"], saved["nll"], saved["margin"]
        logger.info("%s was made for other tokens or another model: running dense again", cache)
    argmax, nll, margin = dense_run(model, ids, context, steps)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(key, argmax=argmax, nll=nll, margin=margin), cache)
    return argmax, nll, margin


def _rescue_arg(text: str) -> int | None:
    """``--page-rescue`` values: tokens, or "default" (None: the backend's default)."""
    return None if text in ("default", "None") else int(text)


def _layers_arg(text: str) -> tuple[int, ...] | None:
    """``--rescue-layers`` values: "all" (None: every layer) or layers and ranges, "0,15-29"."""
    if text == "all":
        return None
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-") if not part.startswith("-") else (part, "", "")
        layers.extend(range(int(first), int(last) + 1) if last else [int(first)])
    return tuple(layers)


def _retrieval_arg(text: str) -> tuple[int, ...] | None:
    """``--retrieval-layers`` values: "default" (None: the backend's eight) or layers and ranges."""
    return None if text == "default" else _layers_arg(text)


def _arg_text(name: str, value) -> str:
    """One value of a list argument as the command line gave it."""
    if name == "rescue_layers":
        return _layers_label(value)
    if name == "retrieval_layers":
        return "default" if value is None else ",".join(map(str, value))
    return "default" if value is None else str(value)


def _layers_label(layers: tuple[int, ...] | None) -> str:
    return "all" if layers is None else ",".join(map(str, layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--candidates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--min-coverage", type=float, nargs="+", default=[0.0],
                        help="fidelity guard thresholds (0 = off)")
    parser.add_argument("--page-rescue", type=_rescue_arg, nargs="+", default=[None],
                        help="tokens of rescued pages per layer (option page_rescue; 0 = off; 'default' = the "
                             "backend's default, 2 x budget); every value is run with every --candidates")
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[],
                        help="option dense_layers for every configuration (layers kept dense; default none)")
    parser.add_argument("--rescue-layers", type=_layers_arg, nargs="+", default=[None],
                        help="option rescue_layers, one run per value: 'all' (every layer) or layers and ranges, "
                             "e.g. 0,15-29")
    parser.add_argument("--retrieval-layers", type=_retrieval_arg, nargs="+", default=[None],
                        help="option retrieval_layers, one run per value: 'default' (the backend's eight layers) or "
                             "layers and ranges, e.g. 4,16")
    parser.add_argument("--inner", default="auto", choices=["auto", "eager"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's and the KV's dtype; the dense reference runs in the same dtype")
    parser.add_argument("--kv-store", nargs="+", default=["model"], choices=["model", "int8"],
                        help="the KV store's values: the model's dtype, or rounded to int8 with per-token scales "
                             "(emulated: benchmarks/kv_int8.py); each is run")
    parser.add_argument("--selection-keys", nargs="+", default=["int8"], choices=["store", "int8"],
                        help="option selection_keys, one run per value: the selection scores the stores' keys or "
                             "the retrieval layers' int8 rows (runtime/key_mirror.py)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dense-cache", type=Path,
                        help="keep the dense reference run here (torch.save) and reuse it when it exists for the "
                             "same context and steps (saves the dense run: minutes at 8K)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tok = load_model("smollm2-135m", getattr(torch, args.dtype))
    ids = harness_ids(tok)
    if ids.shape[1] <= args.context + args.steps:
        raise SystemExit(f"the text has {ids.shape[1]} tokens; need more than context + steps")
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    key = f"{args.context}x{args.steps}" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    res = out.setdefault(key, {"context": args.context, "steps": args.steps, "dtype": args.dtype, "runs": {}})
    dense_argmax, dense_nll, dense_margin = _dense(model, ids, args.context, args.steps, args.dense_cache)
    res["dense_nll"] = float(dense_nll.mean())
    res["dense_near_ties"] = {f"margin<{t:g}": int((dense_margin < t).sum()) for t in NEAR_TIE_NATS}
    res["command"] = "python -m benchmarks.fidelity_backend " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(_arg_text(k, x) for x in v) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None)
    for budget in args.budgets:
        for cand, guard, rescue, layers, lagged, store, scored in [
                (c, g, r, k, q, v, s) for r in args.page_rescue for c in args.candidates for g in args.min_coverage
                for k in args.rescue_layers for q in args.retrieval_layers for v in args.kv_store
                for s in args.selection_keys]:
            name = f"budget={budget} candidates={cand:g} min_coverage={guard:g}"
            options = {"budget": budget, "candidates": cand, "inner": args.inner, "page_rescue": rescue,
                       "rescue_layers": layers}
            if guard:
                options["min_coverage"] = guard
            if lagged is not None:
                options["retrieval_layers"] = lagged
            options["selection_keys"] = scored
            if args.dense_layers:
                options["dense_layers"] = tuple(args.dense_layers)
            rescue = sc.SpeContextConfig.from_options(options).page_rescue  # the default resolved
            name += f" page_rescue={rescue}" + (f" dense_layers={','.join(map(str, args.dense_layers))}"
                                               if args.dense_layers else "")
            name += f" rescue_layers={_layers_label(layers)}" if layers is not None else ""
            name += f" retrieval_layers={','.join(map(str, lagged))}" if lagged is not None else ""
            name += " kv_store=int8" if store == "int8" else ""
            name += f" selection_keys={scored}" if scored != "store" else ""
            run = sparse_run(model, ids, args.context, args.steps, kv_store=store, **options)
            res["runs"][name] = {
                "budget": budget, "candidates": cand if math.isfinite(cand) else "inf", "min_coverage": guard,
                "page_rescue": rescue, "dense_layers": list(args.dense_layers),
                "rescue_layers": _layers_label(layers),
                "retrieval_layers": "default" if lagged is None else list(lagged),
                "kv_store": "int8 (emulated: per-token scales)" if store == "int8" else args.dtype,
                "selection_keys": scored,
                "agreement": float((run["argmax"] == dense_argmax).double().mean()),
                **_lost_steps(run["argmax"], dense_argmax, dense_margin),
                "nll_delta": float(run["nll"].mean()) - res["dense_nll"],
                "paths": run["paths"], "seconds": round(run["seconds"], 1),
                "command": res["command"],  # each run keeps the command that made it (a file gathers several)
            }
            logger.info("%s: %s", name, res["runs"][name])
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
