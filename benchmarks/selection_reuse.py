"""Fidelity if each layer reused its refined selection across decode steps (issue 26, a direction).

The default step re-ranks, in every layer and every step, the step's shared candidates plus
the pages rescued under the layer's current query (``aten_step.refine_selection``): about
0.5 ms per layer at 8K on this CPU, the reason the default costs 1.4x the no-rescue step.
Selections change little from one step to the next, so a layer could refine only every
``--every`` steps and, in between, either

* ``reuse``: attend to its last kept tokens plus the tokens written since (no ranking at all:
  the no-rescue step's cost), or
* ``union``: rank the step's shared candidates together with its last kept tokens and the
  tokens written since, without the page rescue (no bounds read, about 2048 ranked
  instead of 3072).

This script measures what that would cost in fidelity before anything is built: it runs
:mod:`benchmarks.fidelity_backend`'s protocol (dense prefill, teacher-forced steps, agreement
and NLL against one dense run) with the backend's eager step (``--inner eager``: the same
lowered functions, run by the graph module's Python) and replaces
``aten_step.refine_selection`` for the run by a version that keeps, per layer, its last kept
tokens and the length they were kept at. Eager only: the kept state lives in Python, so the
numbers say nothing about speed.

    python -m benchmarks.selection_reuse --mode reuse --every 2 --out docs/results/selection_reuse_8k.json \\
        --context 8192 --steps 128 --budgets 1024 --candidates 1 --page-rescue default --inner eager \\
        --dense-cache out/dense_8k_128.pt

Arguments after ``--mode`` / ``--every`` go to :mod:`benchmarks.fidelity_backend` unchanged;
the result JSON (theirs) gains ``selection_reuse`` (mode, interval, refreshed and reused
site-steps). One configuration per process (the kept state is keyed by store address).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specontext_compile.runtime import aten_step


class ReusedSelection:
    """A stand-in for ``aten_step.refine_selection`` (same signature and results) that
    refines a layer's selection only every ``every`` decode steps; in between it answers
    from the layer's last kept tokens (see the module docstring for ``mode``)."""

    def __init__(self, refine, mode: str, every: int):
        if mode not in ("reuse", "union") or every < 1:
            raise ValueError(f"mode must be 'reuse' or 'union' and every >= 1, got {mode!r}, {every}")
        self.refine, self.mode, self.every = refine, mode, every
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}  # store address -> (kept positions, length then)
        self.refreshed = self.reused = 0
        self.__name__ = self.__qualname__ = refine.__name__  # FX names call targets by it

    def __call__(self, query, key_cache, candidates, length, attn_mask, pages, spec, variant):
        now = int(length)
        last = self.kept.get(key_cache.data_ptr())
        if last is not None and query.shape[2] == 1 and 0 < now - last[1] < self.every:
            self.reused += 1
            kept, then = last
            written = torch.arange(then, now).view(1, 1, -1).expand(kept.shape[0], kept.shape[1], -1)
            if self.mode == "reuse":
                return torch.cat([kept, written], -1), torch.zeros((), dtype=torch.bool)
            return self.refine(query, key_cache, _distinct(torch.cat([candidates, kept, written], -1)), length,
                               attn_mask, (), spec, variant)
        indices, dense = self.refine(query, key_cache, candidates, length, attn_mask, pages, spec, variant)
        self.kept[key_cache.data_ptr()] = (indices, now)
        self.refreshed += 1
        return indices, dense


def _distinct(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` ``[b, kv, n]`` (``-1`` = none) ascending, each once, ``-1`` padding first
    (the candidates' layout the refinement expects: its first valid entries are the sinks)."""
    ordered = positions.sort(-1).values
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return torch.where(repeat, -1, ordered).sort(-1).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["reuse", "union"], required=True)
    parser.add_argument("--every", type=int, required=True, help="refine every N decode steps")
    args, rest = parser.parse_known_args()
    if "--inner" not in rest or rest[rest.index("--inner") + 1] != "eager":
        parser.error("pass --inner eager: the reused state lives in Python, so the step must run eagerly")
    reused = ReusedSelection(aten_step.refine_selection, args.mode, args.every)
    aten_step.refine_selection = reused  # the pass inserts the module's function: this run's graphs call ours
    from benchmarks import fidelity_backend

    sys.argv = [sys.argv[0], *rest]
    fidelity_backend.main()
    out = Path(rest[rest.index("--out") + 1])
    result = json.loads(out.read_text())
    result["selection_reuse"] = {"mode": args.mode, "every": args.every, "refreshed_site_steps": reused.refreshed,
                                 "reused_site_steps": reused.reused,
                                 "command": f"python -m benchmarks.selection_reuse --mode {args.mode} --every "
                                            f"{args.every} " + " ".join(rest)}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
