"""How well the fidelity guard's estimate tracks true recall, and what the two-stage selection buys.

For ``steps`` teacher-forced decode steps after a dense prefill of ``context`` tokens of the
harness's text (:func:`benchmarks.fidelity.record`: every layer's query and keys, exact), and
per layer, it runs the shipped selection code on the recorded tensors:

* the selection node (:func:`~specontext_compile.runtime.scorers.lagged_query_scores` +
  :func:`~specontext_compile.runtime.aten_step.select_positions`, the previous step's queries
  of the retrieval layers) picks ``ceil(candidates * budget)`` candidates;
* the layer's refinement (:func:`~specontext_compile.runtime.aten_step.refine_coverage`)
  keeps ``budget`` of them and returns the guard's *coverage* estimate;
* **true recall**: the share of the layer's dense float64 attention (every cached token)
  that the kept tokens hold, mean over query heads; **worst-head recall**: its minimum.

With ``--page-rescue T`` each layer also adds the ``T`` tokens of the best 16-token pages by
Quest's bound under its own query to the candidates before refining (:func:`page_rescued`,
the backend's option ``page_rescue``, run here on the recorded tensors).

Fixed in issue 12's second pass: the first version passed ``query_valid = 1`` to
``lagged_query_scores``, which then (rightly, for a stale query) fell back to recency scores,
so its tables measured a sink + recent-window selection, not the lagged-query head; the
backend itself was not affected (tests/test_guard_estimate.py pins this).

It reports per ``candidates`` the mean true recall per layer, and the Pearson correlation
between coverage and worst-head recall over (step, layer) pairs, plus the share of layers the
guard would run dense at a few thresholds and the true recall of those it would not.

Run (about 5 minutes at 8K on 2 idle CPU cores)::

    .venv/bin/python -m benchmarks.guard_estimate --context 8192 --steps 9 --budget 1024 \\
        --candidates 1 2 4 8 --out docs/results/guard_estimate_8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from specontext_compile.runtime import aten_step, page_bounds, scorers
from specontext_compile.runtime.sparse_attention import _gather_tokens  # the ops' own gather
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

from benchmarks.fidelity import layer_probs, record
from benchmarks.fidelity_backend import harness_ids
from specontext_compile.config import candidate_slots, default_retrieval_layers
from specontext_compile.models import load_model

__all__ = ["kept_recall", "measure"]


def kept_recall(probs: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """float64 ``[num_heads]``: each query head's dense attention mass (``probs``
    ``[num_heads, n]``) on the positions in ``kept`` (int64 ``[num_kv_heads, slots]``,
    ``-1`` padding; query head ``h`` reads KV head ``h // group``)."""
    n = probs.shape[-1]
    mask = torch.zeros(kept.shape[0], n + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(kept >= 0, kept, n), True)
    mask = mask[:, :n].repeat_interleave(probs.shape[0] // kept.shape[0], 0)
    return (probs * mask).sum(-1)


def page_rescued(cand: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, scale: float, tokens: int
                 ) -> torch.Tensor:
    """The candidates ``[1, num_kv_heads, slots]`` plus, per KV head, the ``tokens`` positions
    of the best 16-token pages by Quest's bound under this layer's own query, as candidates
    ``[1, num_kv_heads, slots']`` (the given ones first, ``-1`` padding): the backend's own page
    rescue (option ``page_rescue``: :func:`~specontext_compile.runtime.page_bounds.update_page_bounds`,
    :func:`~specontext_compile.runtime.page_bounds.page_scores`,
    :func:`~specontext_compile.runtime.page_bounds.rescued_candidates`) on the recorded keys."""
    n = keys.shape[2]
    pages = page_bounds.page_count(n, page_bounds.PAGE_TOKENS)
    lo = keys.new_zeros((*keys.shape[:2], pages, keys.shape[-1]))
    hi = torch.zeros_like(lo)
    length = torch.tensor(n)
    page_bounds.update_page_bounds(keys, lo, hi, length, n, page_bounds.PAGE_TOKENS)
    seen = aten_step.seen_positions(length, None, n, 1, 0, keys.device)
    scores = page_bounds.page_scores(query, lo, hi, seen, scale, page_bounds.PAGE_TOKENS)
    rescue = min(-(-tokens // page_bounds.PAGE_TOKENS), pages)
    return page_bounds.rescued_candidates(cand, scores, seen, rescue, page_bounds.PAGE_TOKENS)


def measure(queries, keys, context: int, scale: float, budget: int, candidates: float, sink: int,
            window: int, retrieval: tuple[int, ...], page_rescue: int = 0) -> list[dict]:
    """Per (step >= 1, layer): coverage estimate, mean and worst-head true recall.
    ``page_rescue``: tokens of Quest pages each layer adds to the candidates
    (:func:`page_rescued`; 0 = the shipped two-stage selection)."""
    rows = []
    layers = len(keys)
    for i in range(1, len(queries)):
        n_after = context + i + 1
        k = [keys[l][:, :, :n_after] for l in range(layers)]
        state = torch.stack([queries[i - 1][j] for j in retrieval])
        # every slot recorded at the previous step's length: the head's real scores (not recency)
        recorded = torch.full((len(retrieval),), n_after - 1, dtype=torch.long)
        scores = scorers.lagged_query_scores(state, recorded, [k[j] for j in retrieval],
                                               torch.tensor(n_after - 1), scale)
        slots = min(candidate_slots(budget, candidates), n_after)
        cand = aten_step.select_positions(scores, torch.tensor(n_after - 1), 1, slots, sink, window)
        for l in range(layers):
            layer_cand = page_rescued(cand, queries[i][l], k[l], scale, page_rescue) if page_rescue else cand
            if layer_cand.shape[-1] > budget:
                # gathered here: a candidate row as wide as the store must not read as "every position"
                keys_l = _gather_tokens(k[l], layer_cand.clamp(min=0))
                kept, coverage = aten_step.refine_gathered(queries[i][l], keys_l, layer_cand, torch.tensor(n_after),
                                                           None, StepSpec(budget, budget, sink, window),
                                                           AttentionVariant(scale))
                cov = float(coverage.min())
            else:
                kept, cov = layer_cand, 1.0
            rec = kept_recall(layer_probs(queries[i][l], k[l], scale), kept[0])
            rows.append({"step": i, "layer": l, "coverage": cov, "recall": float(rec.mean()),
                         "worst_head_recall": float(rec.min())})
    return rows


def _pearson(x: list[float], y: list[float]) -> float:
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den else float("nan")


def summarize(rows: list[dict], thresholds=(0.8, 0.9, 0.95)) -> dict:
    layers = max(r["layer"] for r in rows) + 1
    per_layer = [sum(r["recall"] for r in rows if r["layer"] == l) / sum(1 for r in rows if r["layer"] == l)
                 for l in range(layers)]
    out = {"mean_recall": sum(r["recall"] for r in rows) / len(rows), "per_layer_recall": per_layer,
           "pearson_coverage_vs_worst_head_recall": _pearson([r["coverage"] for r in rows],
                                                             [r["worst_head_recall"] for r in rows]),
           "guard": {}}
    for t in thresholds:
        fire = [r for r in rows if r["coverage"] < t]
        keep = [r for r in rows if r["coverage"] >= t]
        out["guard"][str(t)] = {
            "dense_share": len(fire) / len(rows),
            "recall_with_guard": (len(fire) + sum(r["recall"] for r in keep)) / len(rows),
            "mean_recall_of_kept_sparse": sum(r["recall"] for r in keep) / len(keep) if keep else float("nan"),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--candidates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--retrieval-layers", type=int, nargs="+", default=None,
                        help="layers of the lagged-query head (default: the backend's)")
    parser.add_argument("--page-rescue", type=int, nargs="+", default=[0],
                        help="tokens of Quest pages each layer adds to the candidates (the backend's "
                             "page_rescue, see page_rescued); every value is run with every --candidates")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tok = load_model("smollm2-135m")
    ids = harness_ids(tok)
    queries, keys, _, _ = record(model, ids, args.context, args.steps, 1)
    scale = model.model.layers[0].self_attn.scaling
    retrieval = tuple(args.retrieval_layers or default_retrieval_layers(len(model.model.layers)))
    result = {"command": "python -m benchmarks.guard_estimate " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v is not None),
        "context": args.context, "steps": args.steps, "budget": args.budget, "retrieval_layers": retrieval,
        "runs": {}}
    for c, rescue in [(c, r) for r in args.page_rescue for c in args.candidates]:
        rows = measure(queries, keys, args.context, scale, args.budget, c, args.sink, args.window, retrieval, rescue)
        name = f"{c:g}" + (f"+pages{rescue}" if rescue else "")
        result["runs"][name] = {"summary": summarize(rows), "rows": rows}
        s = result["runs"][name]["summary"]
        print(f"candidates {name}: mean recall {s['mean_recall']:.4f}, pearson(coverage, worst-head recall) "
              f"{s['pearson_coverage_vs_worst_head_recall']:.3f}, guard {s['guard']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
