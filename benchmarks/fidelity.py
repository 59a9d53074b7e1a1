"""Fidelity harness: attention recall of selection policies on real text (issue 6, part).

For each context length, prefills SmolLM2-135M with the first ``context`` tokens of
``pydoc_data.topics`` (dense), then decodes ``--steps`` more tokens of the same text
(teacher-forced, dense), recording every layer's query and keys. Each policy of
``benchmarks/policies.py`` then selects ``budget`` tokens per KV head (4 sinks and a 64-token
window inside the budget, for every policy) and we report the attention recall: the share of
each layer/head's dense attention mass inside the selection, averaged over layers, heads and
steps 1.. (step 0 has no previous query for the lagged-query head).

    python -m benchmarks.fidelity --contexts 2048 4096 8192 --budgets 256 512 1024 2048

Writes a markdown table to stdout and, with ``--out``, JSON.

With ``--metrics agreement nll`` (and optionally ``recall``) each policy runs *inside* the
model's attention instead (:mod:`benchmarks.fidelity_decode`): ``--decode-tokens``
teacher-forced steps after a dense prefill, reporting greedy agreement with a dense run, the
NLL delta (nats/token) and the in-run recall, per policy and budget; ``--plots DIR`` writes
agreement / NLL-delta plots per context:

    python -m benchmarks.fidelity --contexts 8192 --decode-tokens 256 \
        --metrics recall agreement nll --out out/fidelity_decode.json --plots docs
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
from pathlib import Path

import torch
from benchmarks import policies as P
from benchmarks.host_selection import select_tokens
from tqdm.auto import tqdm
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specontext_compile.config import default_retrieval_layers
from specontext_compile.models import load_model

POLICIES = {
    "lagged query x5 (ours)": P.LaggedQuery(),
    "lagged query, layer 8 (ours)": P.LaggedQuery(layers=(8,)),
    "StreamingLLM": P.StreamingLLM(),
    "Quest (16-token pages)": P.Quest(),
    "H2O (accumulated)": P.H2O(),
    "oracle top-k (per layer)": P.OracleTopK(),
    "random": P.RandomTokens(),
    # the backend's default since issue 12's second pass (SmolLM2: 30 layers)
    "lagged query x8 (ours, shipped default)": P.LaggedQuery(layers=default_retrieval_layers(30)),
}
SHORT = dict(zip(["ours", "ours-l8", "streaming", "quest", "h2o", "oracle", "random", "ours-x8"], POLICIES))
DECODE_METRICS = {"recall": "recall (in-run)", "agreement": "greedy agreement", "nll_delta": "NLL delta (nats/token)"}


def record(model, ids: torch.Tensor, context: int, steps: int, h2o_queries: int, aux_layers=()):
    """Dense prefill + teacher-forced decode; returns per-step queries, final keys, the
    last ``h2o_queries`` prompt queries per layer, and (when ``aux_layers``) the hidden
    states after those layers for every token ``[1, tokens, len(aux_layers) * hidden]``."""
    queries: list[dict[int, torch.Tensor]] = []
    prompt_q: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    current: dict[int, torch.Tensor] = {}

    def recording(module, q, k, v, mask, **kw):
        if q.shape[2] > 1:
            prompt_q[module.layer_idx] = q[:, :, -h2o_queries:].detach()
        else:
            current[module.layer_idx] = q.detach()
        keys[module.layer_idx] = k.detach()
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("specontext_fidelity", recording)
    model.set_attn_implementation("specontext_fidelity")
    cache = DynamicCache(config=model.config)
    hidden = []
    want = bool(aux_layers)

    def keep(out):
        if want:
            hidden.append(torch.cat([out.hidden_states[j + 1] for j in aux_layers], -1))

    try:
        with torch.no_grad():
            keep(model(ids[:, :context], cache=cache, use_cache=True, output_hidden_states=want))
            for i in range(context, context + steps):
                current.clear()
                keep(model(ids[:, i : i + 1], cache=cache, use_cache=True, output_hidden_states=want))
                queries.append(dict(current))
    finally:
        model.set_attn_implementation("sdpa")
    aux = torch.cat(hidden, 1) if hidden else None
    return queries, keys, prompt_q, aux


def layer_attention(model) -> list[tuple[float | None, int]]:
    """Per decoder layer ``(soft_cap, sliding_window)`` of its attention as HF computes it
    (Gemma 2's ``attn_logit_softcapping``; a sliding layer's window, 0 for full attention),
    so that recall is measured on the attention the layer really computes."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append((getattr(attn, "attn_logit_softcapping", None), getattr(attn, "sliding_window", None) or 0))
    return out


def _capped(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return logits if soft_cap is None else torch.tanh(logits / soft_cap) * soft_cap


def layer_probs(query: torch.Tensor, keys: torch.Tensor, scale: float, soft_cap: float | None = None,
                sliding_window: int = 0) -> torch.Tensor:
    """float64 ``[num_heads, n]`` dense attention of one query row (position ``n - 1``) over
    ``keys``, as the layer computes it: logits ``q . k * scale``, soft-capped when
    ``soft_cap`` is set; with ``sliding_window > 0`` only positions ``p > n - 1 - window``."""
    g = query.shape[1] // keys.shape[1]
    k = keys[0].double().repeat_interleave(g, 0)
    logits = _capped((query[0, :, 0].double()[:, None] @ k.transpose(-1, -2))[:, 0] * scale, soft_cap)
    if sliding_window > 0:
        logits[:, : max(0, logits.shape[-1] - sliding_window)] = float("-inf")
    return torch.softmax(logits, -1)


def prompt_accumulation(prompt_q, keys, context, scale, attention=None):
    """H2O's accumulated attention from the recorded prompt queries, per layer
    ``[num_kv_heads, total_tokens]`` (causal). ``attention``: optional per-layer
    ``(soft_cap, sliding_window)`` (:func:`layer_attention`) applied as the layer does."""
    acc = {}
    for layer, q in prompt_q.items():
        soft_cap, sliding = attention[layer] if attention is not None else (None, 0)
        k = keys[layer][0, :, :context].double()
        num_kv, g = k.shape[0], q.shape[1] // k.shape[0]
        r = q.shape[2]
        logits = torch.einsum("hrd,hnd->hrn", q[0].double(), k.repeat_interleave(g, 0)) * scale
        logits = _capped(logits, soft_cap)
        pos = torch.arange(context)
        rows = torch.arange(context - r, context)
        hidden = pos[None, None, :] > rows[None, :, None]
        if sliding > 0:
            hidden = hidden | (pos[None, None, :] <= rows[None, :, None] - sliding)
        logits = logits.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(logits, -1).sum(1)  # [heads, context]
        total = torch.zeros(num_kv, keys[layer].shape[2], dtype=torch.float64)
        total[:, :context] = probs.view(num_kv, g, context).amax(1)
        acc[layer] = total
    return acc


def recall_of(selection: torch.Tensor, probs: torch.Tensor) -> float:
    """Mean mass inside ``selection`` ``[num_kv_heads, budget]`` of ``probs`` ``[heads, n]``."""
    n, num_kv = probs.shape[1], selection.shape[0]
    mask = torch.zeros(num_kv, n + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(selection >= 0, selection, n), True)
    mask = mask[:, :n].repeat_interleave(probs.shape[0] // num_kv, 0)
    return float((probs * mask).sum(-1).mean())


def evaluate(model, ids, context, steps, budgets, sink, window, h2o_queries, policies=POLICIES):
    aux_layers = next((tuple(p.head.aux_layer_ids) for p in policies.values() if isinstance(p, P.DraftHead)), ())
    queries, keys, prompt_q, aux = record(model, ids, context, steps, h2o_queries, aux_layers)
    if aux is not None:  # EAGLE-3 feeds the previous token's states
        aux = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)
    scale = model.model.layers[0].self_attn.scaling
    layers = len(model.model.layers)
    attention = layer_attention(model)
    acc = prompt_accumulation(prompt_q, keys, context, scale, attention)
    results = {name: {b: [] for b in budgets} for name in policies}
    for i in tqdm(range(len(queries)), desc=f"context {context}", leave=False):
        n_after = context + i + 1
        step_keys = [keys[l][:, :, :n_after] for l in range(layers)]
        probs = [layer_probs(queries[i][l], step_keys[l], scale, *attention[l]) for l in range(layers)]
        step = P.DecodeStep(
            queries=[queries[i][l] for l in range(layers)], keys=step_keys,
            previous_queries=[queries[i - 1][l] for l in range(layers)] if i else None,
            accumulated=[acc[l].float() for l in range(layers)], scale=scale,
            input_ids=ids[:, :n_after], aux_hidden=None if aux is None else aux[:, :n_after],
        )
        if i:
            for name, policy in policies.items():
                for b in budgets:
                    results[name][b].append(_policy_recall(policy, step, probs, b, sink, window, layers))
        for l in range(layers):  # H2O accumulates this step's attention afterwards
            num_kv = step_keys[l].shape[1]
            acc[l][:, :n_after] += probs[l].view(num_kv, -1, n_after).amax(1)
    return {name: {b: sum(v) / len(v) for b, v in per.items()} for name, per in results.items()}


def _policy_recall(policy, step, probs, budget, sink, window, layers) -> float:
    n_after = step.cached + 1
    select = lambda scores: select_tokens(scores[None], n_after, 1, budget, sink, window)[0]
    if policy.shared:
        sel = select(policy.scores(step, 0))
        return sum(recall_of(sel, probs[l]) for l in range(layers)) / layers
    return sum(recall_of(select(policy.scores(step, l)), probs[l]) for l in range(layers)) / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--h2o-queries", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--heads", type=Path, nargs="*", default=[],
                        help="EAGLE-3-layout head folders (e.g. from `specontext distill`) to compare too")
    parser.add_argument("--metrics", nargs="+", default=["recall"], choices=["recall", "agreement", "nll"],
                        help="agreement / nll run every policy inside the model's attention")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="teacher-forced decode steps per policy run (agreement / nll)")
    parser.add_argument("--policies", nargs="+", default=list(SHORT), choices=list(SHORT))
    parser.add_argument("--plots", type=Path, default=None, help="folder for fidelity_{agreement,nll}_<ctx>.png")
    parser.add_argument("--resume", action="store_true",
                        help="keep the policies already in --out (agreement/nll runs; saved after each policy)")
    parser.add_argument("--plots-from", type=Path, default=None,
                        help="only redraw the --plots of a JSON written by an agreement/nll run")
    args = parser.parse_args()
    if args.plots_from:
        for context, res in json.loads(args.plots_from.read_text()).items():
            plot_decode(res, int(context), args.plots or Path("docs/results"))
        return
    model, tok = load_model("smollm2-135m")
    policies = {SHORT[k]: POLICIES[SHORT[k]] for k in args.policies}
    for folder in args.heads:
        from specontext_compile.runtime.eagle3 import load_eagle3_head

        head, _ = load_eagle3_head(folder, target_embedding=model.model.embed_tokens.weight.detach(),
                                   num_layers=len(model.model.layers))
        fused = json.loads((folder / "config.json").read_text()).get("specontext_variant", "fused") == "fused"
        policies[f"distilled head {folder.name}"] = P.DraftHead(head, fused=fused)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text, return_tensors="pt").input_ids
    if {"agreement", "nll"} & set(args.metrics):
        _decode_main(args, model, ids, policies)
        return
    table = {}
    for context in args.contexts:
        budgets = [b for b in args.budgets if b < context]
        table[context] = evaluate(model, ids, context, args.steps, budgets, args.sink, args.window,
                                  args.h2o_queries, policies)
        print_recall_table(context, args.steps, budgets, table[context])
    if args.out:
        args.out.write_text(json.dumps({str(c): v for c, v in table.items()}, indent=2) + "\n")


def print_recall_table(context: int, steps: int, budgets: list[int], per_policy: dict) -> None:
    """Markdown table of recall per policy (rows) and budget (columns) for one context."""
    print(f"\n### context {context} tokens: attention recall (steps 1..{steps - 1})\n")
    print("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for name, per in per_policy.items():
        print(f"| {name} | " + " | ".join(f"{per[b]:.3f}" for b in budgets) + " |", flush=True)


def _decode_main(args, model, ids, policies) -> None:
    """Policies inside attention: tables per metric, JSON after every context, plots."""
    from benchmarks.fidelity_decode import sweep

    metrics = [m for m in ("recall", "agreement", "nll_delta") if m in args.metrics or
               (m == "nll_delta" and "nll" in args.metrics)]
    table = {}
    if args.resume and args.out and args.out.exists():
        table = {int(c): v for c, v in json.loads(args.out.read_text()).items()}

    def save(partial=None, context=None):
        if partial is not None:
            table[context] = partial
        if args.out:
            args.out.write_text(json.dumps({str(c): v for c, v in table.items()}, indent=2) + "\n")

    for context in args.contexts:
        budgets = [b for b in args.budgets if b < context]
        done = table.get(context)
        if done:  # JSON keys are strings
            done["policies"] = {k: {int(b): r for b, r in per.items()} for k, per in done["policies"].items()}
        res = sweep(model, ids, context, args.decode_tokens, budgets, policies, args.sink, args.window,
                    args.h2o_queries, done=done, on_policy=lambda part, c=context: save(part, c))
        table[context] = res
        for metric in metrics:
            print(f"\n### context {context} tokens, {args.decode_tokens} decode tokens: {DECODE_METRICS[metric]}"
                  + (f" (dense NLL {res['dense_nll']:.3f})" if metric == "nll_delta" else "") + "\n")
            print("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
            print("|---|" + "---|" * len(budgets))
            for name, per in res["policies"].items():
                fmt = "{:+.3f}" if metric == "nll_delta" else "{:.3f}"
                print(f"| {name} | " + " | ".join(fmt.format(per[b][metric]) for b in budgets) + " |", flush=True)
        save()
        if args.plots:
            plot_decode(res, context, args.plots)


def plot_decode(res: dict, context: int, folder: Path) -> list[Path]:
    """Greedy agreement and NLL delta vs budget per policy (one sweep result of
    :func:`benchmarks.fidelity_decode.sweep`), as ``folder/fidelity_{agreement,nll}_<ctx>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    paths = []
    for metric, ylabel, stem in (("agreement", "greedy agreement with dense", "agreement"),
                                 ("nll_delta", "NLL delta vs dense (nats/token)", "nll")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, per in res["policies"].items():
            budgets = sorted(per, key=int)
            ax.plot([int(b) for b in budgets], [per[b][metric] for b in budgets], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"SmolLM2-135M, context {context}, {res['steps']} teacher-forced tokens")
        if metric == "nll_delta":
            ax.axhline(0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
        fig.tight_layout()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"fidelity_{stem}_{label}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    main()
