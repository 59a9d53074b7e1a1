"""One layer's share of a sparse decode step, compiled alone: what the page rescue costs.

The default step (page rescue on) is ~1.5x the no-rescue step on SmolLM2 at 8K (issue 26);
the difference is per layer: the refinement (page scores, the rescued union, a gather of
the candidates' keys, a top-k) before the attention over the kept tokens. This script
compiles, with inductor, the aten bodies the compiled step runs for ONE layer at SmolLM2's
shapes (9 query heads over 3 KV heads, head_dim 64, fp32, batch 1) and times them on
random keys and values, so variants of that work can be compared in seconds instead of
compiling the 30-layer model:

* ``attend`` — sparse attention over a given selection of ``budget`` tokens (no rescue);
* ``refine+attend`` — the default's two bodies: refinement with the page rescue, then
  attention over the kept ``budget`` tokens (what the eager op chain runs);
* ``refine_and_attend`` — the same as one body, the logits computed once (what the lowered
  default step runs, ``passes/lower.py``);
* ``dense`` — SDPA over the whole store with the causal limit (own dense's per-layer step).

``--parts`` times the refinement's pieces instead (cumulative prefixes, each compiled alone);
``--scatter`` the rescued union's membership table built by a bool and by an int32 scatter;
``--products`` the default's and the no-rescue step's site with the query-key products as
fused reductions (what the backend traces on CPU) and as matmuls (before 2026-12-03);
``--bounds`` both sites after the page bounds' update of the step's key, written with
``index_put_`` (in place, what the runtime does) and with ``scatter_`` (before 2026-12-03:
inductor copied each whole bound twice), timed cold: stepped in turn over ``--stores``
layers' stores, as a model's 30 layers read theirs, each round timing every variant once;
``--realized`` both sites with the query made by a rotary embedding inside the graph (as in
the model), the fused products' rows written to a buffer first (what the runtime does) and
recomputed per key (before 2026-12-03), timed cold the same way.

    python -m benchmarks.layer_step --context 8192 --budget 1024 --json out.json
    python -m benchmarks.layer_step --context 8192 --budget 1024 --parts
    python -m benchmarks.layer_step --context 8192 --budget 1024 --scatter
    python -m benchmarks.layer_step --context 8192 --budget 1024 --products
    python -m benchmarks.layer_step --context 8192 --budget 1024 --bounds
    python -m benchmarks.layer_step --context 8192 --budget 1024 --realized
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specontext_compile.runtime import aten_step, routes
from specontext_compile.runtime.page_bounds import PAGE_TOKENS, page_count, update_page_bounds
from specontext_compile.runtime.spec import AttentionVariant, StepSpec


def _inputs(context: int, capacity: int, heads: int, kv_heads: int, head_dim: int, budget: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(1, kv_heads, capacity, head_dim, generator=gen)
    value = torch.randn(1, kv_heads, capacity, head_dim, generator=gen)
    query = torch.randn(1, heads, 1, head_dim, generator=gen)
    length = torch.tensor(context)
    pages = page_count(capacity, PAGE_TOKENS)
    page_min = torch.zeros(1, kv_heads, pages, head_dim)
    page_max = torch.zeros(1, kv_heads, pages, head_dim)
    update_page_bounds(key, page_min, page_max, length, context, PAGE_TOKENS)
    scores = torch.rand(1, kv_heads, capacity, generator=gen)
    candidates = aten_step.select_positions(scores, length - 1, 1, budget, 4, 64)
    return query, key, value, length, page_min, page_max, candidates


def _spec(budget: int, rescue_tokens: int) -> StepSpec:
    return StepSpec(budget, budget, sink_tokens=4, recent_window=64, rescue_tokens=rescue_tokens,
                    page_tokens=PAGE_TOKENS)


def _as_the_pass_decides(spec: StepSpec, variant: AttentionVariant, query, store, **site) -> StepSpec:
    """``spec`` with our CPU kernel where the pass would give it to this site in a step
    inductor compiles (``routes.cpu_kernel``, from the traced values)."""
    compiled = dataclasses.replace(spec, compiled=True)
    return dataclasses.replace(compiled, cpu_kernel=routes.cpu_kernel(query, store, None, compiled, variant, **site))


def variants(budget: int, rescue_tokens: int, scale: float):
    spec, variant = _spec(budget, rescue_tokens), AttentionVariant(scale, fused_products=True)  # as lowered

    def attend(query, key, value, length, page_min, page_max, candidates):
        return aten_step.sparse_attention(query, key, value, candidates, length, None, spec, variant)

    def refine_attend(query, key, value, length, page_min, page_max, candidates):
        kept, _ = aten_step.refine_selection(query, key, candidates, length, None, (page_min, page_max, None), spec,
                                             variant)
        return aten_step.sparse_attention(query, key, value, kept, length, None, spec, variant)

    def fused(query, key, value, length, page_min, page_max, candidates):
        pages = (page_min, page_max, None)
        mine = _as_the_pass_decides(spec, variant, query, (key, value), dense=False, slots=candidates.shape[-1],
                                    pages=pages)
        return aten_step.refine_and_attend(query, (key, value), candidates, length, None, mine, variant, pages)

    def dense(query, key, value, length, page_min, page_max, candidates):
        mine = dataclasses.replace(spec, dense_shortcut=True, route="dense")
        mine = _as_the_pass_decides(mine, variant, query, (key, value), dense=True, slots=None)
        return aten_step.sparse_attention(query, key, value, torch.arange(key.shape[2]).expand(1, key.shape[1], -1),
                                          length, None, mine, variant)

    return {"attend": attend, "refine+attend": refine_attend, "refine_and_attend": fused, "dense": dense}


def parts(budget: int, rescue_tokens: int, scale: float):
    """The refinement's pieces, each compiled alone (``--parts``): cumulative prefixes of
    :func:`aten_step.refine_inputs` / ``refine_gathered``, so a piece's cost is the
    difference between consecutive rows."""
    from specontext_compile.runtime import page_bounds
    from specontext_compile.runtime.sparse_attention import _gather_tokens, selected_logits

    spec, variant = _spec(budget, rescue_tokens), AttentionVariant(scale, fused_products=True)  # as lowered

    def seen(key, length):
        return aten_step.seen_positions(length, None, key.shape[2], 1, 0, key.device)

    def scores(query, key, value, length, page_min, page_max, candidates):
        return page_bounds.page_scores(query, page_min, page_max, seen(key, length), scale, PAGE_TOKENS, fused=True)

    def union(query, key, value, length, page_min, page_max, candidates):
        return aten_step.rescue_pages_into(query, candidates, length, None, key.shape[2], spec, variant,
                                           (page_min, page_max, None))

    def gathered(query, key, value, length, page_min, page_max, candidates):
        rescued = union(query, key, value, length, page_min, page_max, candidates)
        return _gather_tokens(key, rescued.clamp(min=0))

    def logits(query, key, value, length, page_min, page_max, candidates):
        rescued = union(query, key, value, length, page_min, page_max, candidates)
        return selected_logits(query, _gather_tokens(key, rescued.clamp(min=0)), rescued, length, None, variant)

    def refine(query, key, value, length, page_min, page_max, candidates):
        return aten_step.refine_selection(query, key, candidates, length, None, (page_min, page_max, None), spec,
                                          variant)[0]

    return {"page scores": scores, "+ rescued union": union, "+ gather of the keys": gathered,
            "+ logits": logits, "+ softmax, top-k (the refinement)": refine}


def scatter_dtypes(budget: int, rescue_tokens: int, scale: float):
    """The candidates' membership table of the rescued union built with a bool and with an
    int32 scatter (``--scatter``): the same table; inductor's CPU code differs in speed
    (why :func:`~specontext_compile.runtime.page_bounds.rescued_candidates` uses int32)."""

    def membership(dtype):
        def build(query, key, value, length, page_min, page_max, candidates):
            capacity = key.shape[2]
            table = torch.zeros(*candidates.shape[:2], capacity + 1, dtype=dtype)
            table.scatter_(-1, torch.where(candidates >= 0, candidates, capacity), 1)
            return table.gather(-1, torch.arange(capacity).expand(*candidates.shape[:2], capacity)) != 0
        return build

    return {"membership, bool scatter": membership(torch.bool), "membership, int32 scatter": membership(torch.int32)}


def _traced_with(fn, name: str, value):
    """``fn`` run (and so traced) with ``sparse_attention.<name>`` set to ``value``: the
    runtime reads these flags at trace time."""
    from specontext_compile.runtime import sparse_attention

    def traced(*args):
        kept = getattr(sparse_attention, name)
        setattr(sparse_attention, name, value)
        try:
            return fn(*args)
        finally:
            setattr(sparse_attention, name, kept)
    return traced


def products(budget: int, rescue_tokens: int, scale: float):
    """The default's site (``refine_and_attend``, page rescue on), the no-rescue step's
    (``attend``) and the page scores, each traced with the query-key products as fused
    reductions and as matmuls (``--products``: ``sparse_attention.FUSED_PRODUCT_ROWS`` set to
    0 while the matmul variant is traced)."""
    from specontext_compile.runtime import sparse_attention

    table = {**variants(budget, rescue_tokens, scale), **parts(budget, rescue_tokens, scale)}
    rows = sparse_attention.FUSED_PRODUCT_ROWS
    return {f"{name}, {label}": _traced_with(table[name], "FUSED_PRODUCT_ROWS", n)
            for name in ("refine_and_attend", "attend", "page scores")
            for label, n in (("fused products", rows), ("matmuls", 0))}


def _scatter_update(key_cache, page_min, page_max, length, q_len, page_tokens):
    """The page bounds' update as written before 2026-12-03 (``scatter_`` of the touched pages;
    no page shift), for ``--bounds``: the same values as
    :func:`~specontext_compile.runtime.page_bounds.update_page_bounds`."""
    b, kv, capacity, d = key_cache.shape
    pages = page_min.shape[2]
    touched = min(pages, -(-(q_len - 1) // page_tokens) + 1)
    first = ((length - q_len) // page_tokens).clamp(max=pages - touched).clamp(min=0)
    page_ids = (first + torch.arange(touched)).view(1, touched, 1).expand(b, touched, 1)
    pos = page_ids * page_tokens + torch.arange(page_tokens)
    valid = (pos < length) & (pos < capacity)
    index = pos.clamp(0, capacity - 1).view(b, 1, touched * page_tokens, 1).expand(b, kv, -1, d)
    keys = key_cache.gather(2, index).view(b, kv, touched, page_tokens, d)
    inside = valid.view(b, 1, touched, page_tokens, 1)
    lo = torch.where(inside, keys, float("inf")).amin(3)
    hi = torch.where(inside, keys, float("-inf")).amax(3)
    written = valid.any(-1).view(b, 1, touched, 1)
    rows = page_ids.view(b, 1, touched, 1).expand(b, kv, touched, d)
    page_min.scatter_(2, rows, torch.where(written, lo, 0.0))
    page_max.scatter_(2, rows, torch.where(written, hi, 0.0))


def bounds_updates(budget: int, rescue_tokens: int, scale: float):
    """The default's site and the no-rescue site, each after the bounds' update of one written
    token, with the update in place (``index_put_``) and as before (``scatter_``)."""
    sites = variants(budget, rescue_tokens, scale)

    def with_update(update, site):
        def step(query, key, value, length, page_min, page_max, candidates):
            update(key, page_min, page_max, length, 1, PAGE_TOKENS)
            return site(query, key, value, length, page_min, page_max, candidates)
        return step

    return {f"{name}, bounds by {label}": with_update(update, sites[name])
            for name in ("refine_and_attend", "attend")
            for label, update in (("index_put_", update_page_bounds), ("scatter_", _scatter_update))}


def time_cold(compiled: dict, stores: list, rounds: int) -> dict[str, list[float]]:
    """ms per call of each compiled variant, stepped over every store in turn (each store read
    once per pass, so a call finds its store out of cache as a model's layer does), the
    variants interleaved round by round; the first round is warm-up."""
    times = {name: [] for name in compiled}
    for round_ in range(rounds + 1):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            for inputs in stores:
                fn(*inputs)
            if round_:
                times[name].append(1000 * (time.perf_counter() - t0) / len(stores))
    return times


def _rotary(query, cos, sin):
    """The model's rotary embedding of the raw query (as Llama's ``apply_rotary_pos_emb``)."""
    half = query.shape[-1] // 2
    return query * cos + torch.cat([-query[..., half:], query[..., :half]], -1) * sin


def realized_rows(budget: int, rescue_tokens: int, scale: float):
    """Both sites with the query made inside the graph by a rotary embedding, as in the model
    (layer_step's other tables take it as an input, a buffer already), traced with the fused
    products' rows written to a buffer first and as before (recomputed per key):
    ``sparse_attention.REALIZE_ROWS`` off while the second is traced."""
    sites = variants(budget, rescue_tokens, scale)
    gen = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(1, 1, 1, 64, generator=gen), torch.randn(1, 1, 1, 64, generator=gen)

    def rotary_site(site):
        def step(query, key, value, length, page_min, page_max, candidates):
            return site(_rotary(query, cos, sin), key, value, length, page_min, page_max, candidates)
        return step

    return {f"{name}, rows {label}": _traced_with(rotary_site(sites[name]), "REALIZE_ROWS", realize)
            for name in ("refine_and_attend", "attend")
            for label, realize in (("realized", True), ("recomputed", False))}


def _compiled(fn, inputs):
    """``fn`` traced to aten (``make_fx``) and compiled by inductor, as the backend compiles the
    lowered step (its variants with ``fused_products``, as the lowering sets them): dynamo
    cannot trace attribute reads of the opaque specs a closure holds."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    return compile_fx(make_fx(fn)(*inputs), list(inputs))


def time_fn(fn, args, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(1000 * (time.perf_counter() - t0))
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rescue", type=int, default=None, help="rescued tokens (default: 2 x budget)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", nargs="+", default=None)
    parser.add_argument("--parts", action="store_true", help="time the refinement's pieces instead")
    parser.add_argument("--scatter", action="store_true",
                        help="time the rescued union's membership table as a bool and as an int32 scatter")
    parser.add_argument("--products", action="store_true",
                        help="time the sites with the query-key products fused and as matmuls")
    parser.add_argument("--bounds", action="store_true",
                        help="time both sites after the bounds' update, in place and as a scatter_ (cold)")
    parser.add_argument("--realized", action="store_true",
                        help="time both sites with a rotary query, the fused products' rows realized and recomputed (cold)")
    parser.add_argument("--stores", type=int, default=30, help="--bounds / --realized: distinct stores stepped in turn")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rescue = 2 * args.budget if args.rescue is None else args.rescue
    if args.bounds or args.realized:
        rows = _cold_rows(args, rescue, bounds_updates if args.bounds else realized_rows)
    else:
        rows = _hot_rows(args, rescue)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(["python -m benchmarks.layer_step", *(argv or sys.argv[1:])]),
                                         "context": args.context, "budget": args.budget, "rescue_tokens": rescue,
                                         "parts": args.parts, "scatter": args.scatter, "products": args.products,
                                         "bounds": args.bounds, "realized": args.realized,
                                         "stores": args.stores if args.bounds or args.realized else None,
                                         "torch": torch.__version__, "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=2))
    return 0


def _hot_rows(args, rescue: int) -> list[dict]:
    """The default tables (variants, ``--parts``, ``--scatter``, ``--products``): each variant
    compiled, then timed alone on one store, ``--steps`` calls after ``--warmup``."""
    kind = (scatter_dtypes if args.scatter else parts if args.parts else products if args.products
            else variants)
    inputs = _inputs(args.context, args.context + 64, 9, 3, 64, args.budget, seed=0)
    rows = []
    with torch.no_grad():
        for name, fn in kind(args.budget, rescue, 64 ** -0.5).items():
            if args.only and name not in args.only:
                continue
            t0 = time.perf_counter()
            compiled = _compiled(fn, inputs)
            compiled(*inputs)
            compile_s = time.perf_counter() - t0
            ms = time_fn(compiled, inputs, args.steps, args.warmup)
            rows.append({"variant": name, "ms_median": statistics.median(ms), "ms_min": min(ms),
                         "compile_s": compile_s})
            print(f"{name:<36} {statistics.median(ms):7.3f} ms/layer (min {min(ms):.3f}), compile {compile_s:.1f} s",
                  flush=True)
    return rows


def _cold_rows(args, rescue: int, table) -> list[dict]:
    """``--bounds`` / ``--realized``: compile each variant of ``table``, then time them cold and
    interleaved."""
    stores = [_inputs(args.context, args.context + 64, 9, 3, 64, args.budget, seed=i) for i in range(args.stores)]
    with torch.no_grad():
        compiled = {}
        for name, fn in table(args.budget, rescue, 64 ** -0.5).items():
            compiled[name] = _compiled(fn, stores[0])
            compiled[name](*stores[0])
        times = time_cold(compiled, stores, max(args.steps // args.stores, 5))
    rows = []
    for name, ms in times.items():
        rows.append({"variant": name, "ms_median": statistics.median(ms), "ms_min": min(ms), "rounds": len(ms)})
        print(f"{name:<48} {statistics.median(ms):7.3f} ms/layer (min {min(ms):.3f}, cold)", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
