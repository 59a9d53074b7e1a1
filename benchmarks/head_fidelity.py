"""Attention recall of retrieval heads (distilled or shipped) vs a few baselines.

The same measurement as :mod:`benchmarks.fidelity` (its recording, dense attention, the
shared selection with 4 sinks and a 64-token window inside the budget, and its recall),
restricted to the policies a retrieval head is judged against: our lagged-query head,
StreamingLLM and Quest by default. Each policy scores a step once and every budget reuses
the scores (fidelity re-scores per budget), which makes an 8K run several times cheaper.

    python -m benchmarks.head_fidelity --contexts 2048 8192 --budgets 256 512 1024 2048 --steps 9 \\
        --heads smollm2-135m-embedding smollm2-135m-fused

``--heads`` takes shipped head names (``specontext_compile.runtime.heads``) or folders.
"""

from __future__ import annotations

import argparse
import json
import logging
import pydoc_data.topics
from pathlib import Path

import torch
from benchmarks import policies as P
from benchmarks.host_selection import select_tokens
from tqdm.auto import tqdm

from benchmarks.fidelity import layer_probs, print_recall_table, recall_of, record
from specontext_compile.models import load_model

logger = logging.getLogger(__name__)

BASELINES = {
    "lagged query x5 (ours)": P.LaggedQuery(),
    "StreamingLLM": P.StreamingLLM(),
    "Quest (16-token pages)": P.Quest(),
}


def head_policy(name_or_folder: str, embedding: torch.Tensor) -> tuple[str, P.DraftHead]:
    """``(label, DraftHead)`` for a shipped head name or an EAGLE-3-layout folder."""
    from specontext_compile.runtime import heads
    from specontext_compile.runtime.eagle3 import load_eagle3_head

    folder = heads.path_of(name_or_folder) if name_or_folder in heads.available() else Path(name_or_folder)
    head, _ = load_eagle3_head(folder, target_embedding=embedding)
    variant = json.loads((folder / "config.json").read_text()).get("specontext_variant", "fused")
    return f"head {folder.name}", P.DraftHead(head, fused=variant == "fused")


def evaluate(model, ids, context, steps, budgets, policies, sink=4, window=64) -> dict:
    """Mean recall ``{policy: {budget: float}}`` over decode steps ``1 .. steps-1`` (step 0
    has no previous query for the lagged-query head), all layers and query heads."""
    aux_layers = next((tuple(p.head.aux_layer_ids) for p in policies.values() if isinstance(p, P.DraftHead)), ())
    queries, keys, _, aux = record(model, ids, context, steps, 1, aux_layers)
    if aux is not None:  # EAGLE-3 feeds the previous token's states
        aux = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)
    scale = model.model.layers[0].self_attn.scaling
    layers = len(model.model.layers)
    sums = {name: {b: 0.0 for b in budgets} for name in policies}
    for i in tqdm(range(1, len(queries)), desc=f"context {context}", leave=False):
        n_after = context + i + 1
        step_keys = [keys[l][:, :, :n_after] for l in range(layers)]
        probs = [layer_probs(queries[i][l], step_keys[l], scale) for l in range(layers)]
        step = P.DecodeStep(
            queries=[queries[i][l] for l in range(layers)], keys=step_keys,
            previous_queries=[queries[i - 1][l] for l in range(layers)], accumulated=None, scale=scale,
            input_ids=ids[:, :n_after], aux_hidden=None if aux is None else aux[:, :n_after],
        )
        for name, policy in policies.items():
            scores = [policy.scores(step, 0)] if policy.shared else [policy.scores(step, l) for l in range(layers)]
            for b in budgets:
                sel = [select_tokens(s[None], n_after, 1, b, sink, window)[0] for s in scores]
                sums[name][b] += sum(recall_of(sel[0 if policy.shared else l], probs[l])
                                     for l in range(layers)) / layers
    return {name: {b: v / (len(queries) - 1) for b, v in per.items()} for name, per in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--heads", nargs="+", required=True, help="shipped head names or head folders")
    parser.add_argument("--no-baselines", action="store_true", help="only the heads")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the tables")
    args = parser.parse_args()
    model, tok = load_model("smollm2-135m")
    embedding = model.model.embed_tokens.weight.detach()
    policies = {} if args.no_baselines else dict(BASELINES)
    policies.update(head_policy(h, embedding) for h in args.heads)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text, return_tensors="pt").input_ids
    table = {}
    for context in args.contexts:
        budgets = [b for b in args.budgets if b < context]
        table[context] = evaluate(model, ids, context, args.steps, budgets, policies)
        print_recall_table(context, args.steps, budgets, table[context])
    if args.out:
        args.out.write_text(json.dumps({str(c): v for c, v in table.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
