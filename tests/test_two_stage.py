"""Two-stage selection (issue 12): per-layer refinement of a speculative candidate set, the
fidelity guard, and padding-aware selection — values against float64 references, the path
that ran asserted by its counters, and negative tests that the rewrite stays off where it must."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import specontext_compile as sc
from specontext_compile.runtime import aten_step
from specontext_compile.tiny_models import tiny_family
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from _tiny import compiled_steps, decode_graph_ops
from specontext_compile.backend import clear_compile_reports

def _refine_reference(query, keys, candidates, length, scale, budget, sink, window, keep=None):
    """float64 by hand: per KV head, softmax over the visible candidates per query head and
    row, max over them, forced first sinks / recent window, top ``budget``; also the coverage
    (of the kept positions ``keep[i][k]`` instead, when given) and every candidate's score."""
    b, h, q_len, d = query.shape
    kv = keys.shape[1]
    g = h // kv
    kept, coverage, scores = [], torch.ones(b, kv, dtype=torch.float64), {}
    for i in range(b):
        row = []
        for k in range(kv):
            cand = [int(p) for p in candidates[i, k] if p >= 0]
            probs = []
            for hh in range(k * g, (k + 1) * g):
                for r in range(q_len):
                    limit = length - q_len + r
                    vis = [p for p in cand if p <= limit]
                    s = torch.stack([keys[i, k, p].double() @ query[i, hh, r].double() * scale for p in vis])
                    w = dict(zip(vis, torch.softmax(s, 0).tolist()))
                    probs.append([w.get(p, 0.0) for p in cand])
            score = torch.tensor(probs).amax(0)
            recent = min(max(window, q_len), budget)
            sinks = min(sink, budget - recent)
            forced = [j for j, p in enumerate(cand) if j < sinks or p >= length - recent]
            rest = sorted((j for j in range(len(cand)) if j not in forced), key=lambda j: -score[j])
            chosen = (forced + rest)[:budget] if keep is None else [j for j, p in enumerate(cand) if p in keep[i][k]]
            row.append(sorted(cand[j] for j in chosen))
            scores[(i, k)] = {p: float(score[j]) for j, p in enumerate(cand)}
            mass = torch.tensor(probs)[:, chosen].sum(-1)
            coverage[i, k] = mass.min()
        kept.append(row)
    return kept, coverage, scores


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), groups=st.sampled_from([1, 3]), q_len=st.sampled_from([1, 2]),
       budget=st.integers(4, 10), extra=st.integers(1, 12), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_refine_keeps_each_layers_own_top_budget_and_reports_its_coverage(seed, groups, q_len, budget, extra,
                                                                            dtype):
    """Kept positions equal the float64 hand computation (set equality in float32, where random
    logits make ties improbable; in float16, whose products round each logit, the sets may
    differ only by candidates whose float64 scores lie within 5e-3 of each other: seed 324
    swapped two 9e-5 apart) and the coverage estimate matches to 1e-5 (5e-3 in half precision: the
    query is scaled in its own dtype before the product, as the model's attention does, a
    relative error up to 2**-11 per logit; seed 2846 measured 2.2e-3)."""
    g = torch.Generator().manual_seed(seed)
    b, kv, d, capacity = 2, 2, 16, 40
    length = 30
    query = (torch.randn(b, kv * groups, q_len, d, generator=g) * 2).to(dtype)
    keys = (torch.randn(b, kv, capacity, d, generator=g) * 2).to(dtype)
    slots = budget + extra
    step = torch.arange(length - q_len, length)  # the step's tokens are always candidates

    def row():
        return torch.cat([torch.randperm(length - q_len, generator=g)[: slots - q_len], step]).sort().values

    cand = torch.stack([torch.stack([row() for _ in range(kv)]) for _ in range(b)])
    indices, coverage = aten_step.refine_coverage(query, keys, cand, torch.tensor(length), None,
                                                  StepSpec(budget, budget, sink_tokens=2, recent_window=3),
                                                  AttentionVariant(d ** -0.5))
    ref, ref_cov, ref_scores = _refine_reference(query.float(), keys.float(), cand, length, d ** -0.5, budget, 2, 3)
    got = indices.sort(-1).values.tolist()
    if dtype == torch.float32:
        assert got == ref  # a set: the refinement keeps no order
    else:  # float16 products round each logit (2**-11 relative): kept sets may differ at near-ties only
        for i, k in ref_scores:
            swapped = [ref_scores[i, k][p] for p in set(got[i][k]) ^ set(ref[i][k])]
            assert not swapped or max(swapped) - min(swapped) < 5e-3, (i, k, swapped)
        # the coverage of the set it kept (a near-tie swap moves the per-head masses)
        _, ref_cov, _ = _refine_reference(query.float(), keys.float(), cand, length, d ** -0.5, budget, 2, 3, keep=got)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(coverage.double(), ref_cov, atol=tol, rtol=0)


def test_refine_in_half_precision_does_not_overflow():
    """Products above 65504 before scaling (head_dim 128, entries ~24): the refinement scores
    with the query scaled first, so the strongly aligned key is kept and nothing is NaN."""
    torch.manual_seed(0)
    d = 128
    base = torch.randn(d).sign()
    query = (base * 24).half().view(1, 1, 1, d)
    keys = (torch.randn(1, 1, 64, d) * 2).half()
    keys[0, 0, 10] = (base * 24).half()
    cand = torch.arange(0, 48, 2).view(1, 1, -1)
    indices, coverage = aten_step.refine_coverage(query, keys, cand, torch.tensor(48), None,
                                                  StepSpec(4, 4, recent_window=1), AttentionVariant(d ** -0.5))
    assert 10 in indices[0, 0].tolist()
    assert torch.isfinite(coverage).all() and coverage.item() > 0.99


def test_refine_coverage_tracks_true_recall_across_budgets():
    """The estimate rises with the budget and equals 1 when every candidate is kept."""
    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 3, 1, 16, generator=g) * 3
    keys = torch.randn(1, 1, 64, 16, generator=g) * 3
    cand = torch.arange(0, 64, 2).view(1, 1, -1)
    covs = [aten_step.refine_coverage(query, keys, cand, torch.tensor(64), None, StepSpec(b, b, recent_window=1),
                                      AttentionVariant(0.25))[1].item()
            for b in (2, 8, 16, 32)]
    assert covs == sorted(covs) and covs[-1] == pytest.approx(1.0, abs=1e-6) and covs[0] < 0.9


def _select_with_mask(mask_row, scores, cached, slots, sink, window):
    visible = mask_row.view(1, 1, -1)
    return aten_step.select_positions(scores, torch.tensor(cached), 1, slots, sink, window, 0, visible)


def test_selection_never_takes_a_pad_and_keeps_the_rows_first_real_tokens_as_sinks():
    """A left-padded row: no pad selected, sinks = first visible tokens, and the real
    positions chosen equal those of the same row without padding (shifted)."""
    pad, real, cap = 7, 20, 32
    g = torch.Generator().manual_seed(1)
    scores_real = torch.rand(1, 2, real + 1, generator=g)
    scores = torch.cat([torch.rand(1, 2, pad, generator=g) * 10, scores_real,
                        torch.zeros(1, 2, cap - pad - real - 1)], -1)  # pads score high
    mask = torch.zeros(cap, dtype=torch.bool)
    mask[pad : pad + real + 1] = True
    padded = _select_with_mask(mask, scores, pad + real, 10, 2, 3)
    alone = aten_step.select_positions(torch.cat([scores_real, torch.zeros(1, 2, cap - real - 1)], -1),
                                       torch.tensor(real), 1, 10, 2, 3)
    assert (padded >= pad).all()
    assert torch.equal(padded - pad, alone)
    assert {pad, pad + 1} <= set(padded[0, 0].tolist())


def _generate(model, ids, mask, new, **options):
    """Greedy ``generate`` through ``sc.compile``: the logits ``[batch, new, vocab]`` and the
    path counters of that call (the model's, added by the compiled steps)."""
    torch._dynamo.reset()
    sc.compile(model, **options)
    before = sc.path_counts(model)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        counts = {k: v - before[k] for k, v in sc.path_counts(model).items()}
    finally:
        sc.api.restore(model)
    return torch.stack(out.logits, 1), counts


def padded_and_alone(model, pad: int, alone_len: int, **options):
    """A batch of a prompt left-padded by ``pad`` tokens and another prompt, generated 6
    greedy tokens through ``sc.compile(model, **options)``, then the first prompt alone: the
    padded row's logits, the alone row's, and both calls' path counters (seed 5)."""
    g = torch.Generator().manual_seed(5)
    b = torch.randint(1, 128, (1, alone_len + pad), generator=g)
    a = torch.randint(1, 128, (1, alone_len), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    padded, padded_counts = _generate(model, batch, mask, 6, **options)
    alone, alone_counts = _generate(model, a, torch.ones_like(a), 6, **options)
    return padded[0], alone[0], padded_counts, alone_counts


# slow tier: the fast left-padding test is test_page_rescue.py's (pad 15 on the op chain; its
# default-step twin is in the slow tier too)
@pytest.mark.slow
@pytest.mark.parametrize("candidates", [1.0, 2.0])
def test_left_padded_row_decodes_as_the_prompt_alone(candidates):
    """Padding invariance (what dense decoding has): a row padded on the left gives the same
    logits as its prompt alone, with a budget far below the context (sparse path)."""
    model = tiny_family("llama", "sdpa")
    padded, alone, counts, alone_counts = padded_and_alone(
        model, 15, 26, budget=10, recent_window=3, sink_tokens=2, candidates=candidates)  # the default step
    layers = len(model.model.layers)
    assert counts["gather_sites"] == counts["sparse_sites"] == 5 * layers, counts  # 5 decode steps
    assert alone_counts["gather_sites"] == 5 * layers, alone_counts
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=0)


@pytest.mark.slow  # fast tier: candidates on the default step in the guard test's [candidates-auto] case
def test_compiled_two_stage_step_equals_the_eager_op_chain():
    """Inductor-compiled (refinement lowered to aten) == eager ops, same path counts."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    clear_compile_reports()
    eager, c_eager = compiled_steps(model, ids, 5, budget=12, candidates=2.0, inner="eager", lower=False)
    assert decode_graph_ops("refine_selection") == len(model.model.layers)  # every layer refines
    compiled, c_ind = compiled_steps(model, ids, 5, budget=12, candidates=2.0)
    torch.testing.assert_close(compiled, eager, atol=2e-4, rtol=0)
    assert c_ind.path_counts() == c_eager.path_counts()
    assert c_ind.path_counts()["gather_sites"] == 5 * len(model.model.layers)


def test_candidates_covering_the_context_give_each_layer_its_own_top_budget():
    """With every token a candidate, each layer attends to its own top-``budget`` tokens: the
    output of one layer equals float64 attention over exactly the positions that layer's
    query ranks highest (computed here by hand from the captured query and keys)."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    seen = []
    real = aten_step.sparse_attention

    def spy(query, key_cache, value_cache, indices, length, *rest, **kw):
        out = real(query, key_cache, value_cache, indices, length, *rest, **kw)
        seen.append((query.clone(), key_cache.clone(), value_cache.clone(), indices.clone(), int(length), out))
        return out

    aten_step.sparse_attention = spy
    try:
        compiled_steps(model, ids, 2, budget=8, candidates=8.0, sink_tokens=1, recent_window=2, inner="eager")
    finally:
        aten_step.sparse_attention = real
    assert seen
    for query, keys, values, indices, length, out in seen[-3:]:
        d = query.shape[-1]
        scale = d ** -0.5
        every = torch.arange(length).view(1, 1, -1).expand(1, keys.shape[1], length)
        want, _, _ = _refine_reference(query, keys, every, length, scale, 8, 1, 2)
        assert indices.sort(-1).values.tolist() == want  # a set: the refinement keeps no order
        g = query.shape[1] // keys.shape[1]
        for h in range(query.shape[1]):
            pos = want[0][h // g]
            w = torch.softmax(keys[0, h // g, pos].double() @ query[0, h, 0].double() * scale, 0)
            torch.testing.assert_close(out[0, h, 0].double(), w @ values[0, h // g, pos].double(),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("inner", ["auto", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ranked", [dict(candidates=3.0, page_rescue=0),
                                    pytest.param(dict(candidates=1.0), marks=pytest.mark.slow)],
                         ids=["candidates", "page-rescue-only"])
def test_guard_runs_dense_where_the_selection_misses_and_counts_it(ranked, inner):
    """A random tiny model attends almost uniformly, so keeping 6 of 18 candidates (or of the
    shared selection plus one rescued 16-token page, the default rescue at ``candidates=1``)
    holds at most about a third of their mass: the guard at 0.999 runs every site dense — the
    step then equals the dense model exactly and ``guard_dense_sites`` counts every site; at
    0.01 it never fires and the step differs from dense (the sparse path ran)."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        token = model(ids).logits[:, -1:].argmax(-1)
        dense = model(torch.cat([ids, token], 1)).logits[:, -1]
    opts = dict(budget=6, sink_tokens=1, recent_window=1, **ranked)
    layers = len(model.model.layers)
    fired, cache = compiled_steps(model, ids, 1, min_coverage=0.999, inner=inner, **opts)
    assert cache.path_counts()["guard_dense_sites"] == layers
    torch.testing.assert_close(fired[:, 0], dense, atol=1e-4, rtol=0)
    quiet, cache = compiled_steps(model, ids, 1, min_coverage=0.01, inner=inner, **opts)
    assert cache.path_counts()["guard_dense_sites"] == 0
    assert cache.path_counts()["gather_sites"] == layers
    assert (quiet[:, 0] - dense).abs().max() > 1e-3


def test_guarded_attention_is_dense_attention_when_it_fires():
    """The branch itself: ``dense=True`` equals float64 attention over every written token,
    ``dense=False`` equals the gather path over the selection (soft cap included)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k = torch.randn(1, 2, 24, 16, generator=g)
    v = torch.randn(1, 2, 24, 16, generator=g)
    idx = torch.tensor([[[0, 3, 5, 19], [1, 2, 7, 19]]])
    length = torch.tensor(20)
    for cap in (None, 5.0):
        variant = AttentionVariant(0.25, cap)
        dense = aten_step.guarded_attention(q, (k, v), idx, length, None, variant, torch.tensor(True))
        sparse = aten_step.guarded_attention(q, (k, v), idx, length, None, variant, torch.tensor(False))
        for h in range(4):
            s = k[0, h // 2, :20].double() @ q[0, h, 0].double() * 0.25
            if cap:
                s = torch.tanh(s / cap) * cap
            torch.testing.assert_close(dense[0, h, 0].double(), torch.softmax(s, 0) @ v[0, h // 2, :20].double(),
                                       atol=1e-5, rtol=0)
            pos = idx[0, h // 2]
            torch.testing.assert_close(sparse[0, h, 0].double(),
                                       torch.softmax(s[pos], 0) @ v[0, h // 2, pos].double(), atol=1e-5, rtol=0)


def test_no_refinement_where_it_must_not_fire():
    """candidates=1 without a page rescue, or a store no larger than the budget (the default
    rescue included): no refine node in the graph."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(7))
    for options in ({"budget": 8, "page_rescue": 0}, {"budget": 64, "candidates": 4.0}, {"budget": 64}):
        clear_compile_reports()
        _, cache = compiled_steps(model, ids, 2, inner="eager", **options)
        assert decode_graph_ops("refine_selection") == 0, options
        assert decode_graph_ops("sparse_attention") == len(model.model.layers), options
        assert cache.path_counts()["sparse_sites"] == 2 * len(model.model.layers)
        assert cache.path_counts()["page_rescue_sites"] == 0


@pytest.mark.parametrize("bad,match", [
    ({"candidates": 0.5}, "candidates"), ({"candidates": float("nan")}, "candidates"),
    ({"candidates": True}, "candidates"), ({"min_coverage": 1.0, "candidates": 2}, "min_coverage"),
    ({"min_coverage": 0.5, "page_rescue": 0}, "needs a refinement"),
    ({"candidates": 2, "min_coverage": 0.5, "device_memory_bytes": 1 << 20}, "min_coverage=0"),
])
def test_bad_two_stage_options_name_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        sc.SpeContextConfig(**bad)


def test_prefetch_tokens_are_the_candidate_slots():
    assert sc.SpeContextConfig(budget=100, candidates=1.5).prefetch_tokens == 150
    assert sc.SpeContextConfig(budget=100).prefetch_tokens == 100
    assert sc.SpeContextConfig(budget=3, candidates=1.1).prefetch_tokens == math.ceil(3.3)


def test_candidate_slots_round_up():
    from specontext_compile.passes.sparse_rewrite import SparseAttentionPass

    p = SparseAttentionPass.from_config(sc.SpeContextConfig(budget=100, candidates=1.5))
    assert p.step.candidate_slots == 150
    assert SparseAttentionPass.from_config(sc.SpeContextConfig(budget=3, candidates=1.1)).step.candidate_slots == 4
    assert StepSpec.from_config(sc.SpeContextConfig(budget=3, candidates=1.1)).candidate_slots == math.ceil(3.3)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), pads=st.integers(0, 5), window=st.sampled_from([0, 7]),
       additive=st.booleans(), q_len=st.sampled_from([1, 2]))
def test_refinement_over_the_whole_store_equals_the_gathered_one(seed, pads, window, additive, q_len):
    """candidates=inf reads the store in place: the same kept positions and coverage as the
    gather path given the same candidate set (every position the step's rows may see)."""
    g = torch.Generator().manual_seed(seed)
    b, kv, heads, d, capacity, written = 2, 2, 4, 8, 40, 31
    query = torch.randn(b, heads, q_len, d, generator=g)
    keys = torch.randn(b, kv, capacity, d, generator=g)
    length = torch.tensor(written)
    visible = torch.ones(b, 1, capacity, dtype=torch.bool)
    visible[1, :, :pads] = False  # row 1 is left-padded
    mask = visible[:, :, None, :].expand(b, 1, q_len, capacity)
    if additive:
        mask = torch.zeros(b, 1, q_len, capacity).masked_fill(~mask, torch.finfo(torch.float32).min)
    covering = torch.full((b, kv, capacity), 0)  # width == capacity: the in-place path
    scores = torch.rand(b, kv, capacity, generator=g)
    seen = aten_step.select_positions(scores, length - q_len, q_len, capacity - 1, 0, 0, window, visible)
    args = (length, mask, StepSpec(6, 6, sink_tokens=2, recent_window=3), AttentionVariant(0.3, None, window))
    kept_all, cov_all = aten_step.refine_coverage(query, keys, covering, *args)
    kept_gather, cov_gather = aten_step.refine_coverage(query, keys, seen, *args)
    assert torch.equal(kept_all.sort(-1).values, kept_gather.sort(-1).values)  # sets
    torch.testing.assert_close(cov_all, cov_gather, atol=1e-6, rtol=1e-6)


SMALL_WINDOW = {"budget": 8, "sink_tokens": 1, "recent_window": 2, "inner": "eager"}  # 5 slots chosen by score


def test_candidates_inf_is_each_layers_exact_top_budget():
    """candidates=inf end to end: the same logits as a finite candidate set that holds every
    written token on the gather path (so the in-place path keeps what the gather path keeps),
    and not the shared selection's (the refinement really ran: a refinement per layer in
    the decode graph, and other logits)."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(4))
    clear_compile_reports()
    every, cache = compiled_steps(model, ids, 4, candidates=float("inf"), **SMALL_WINDOW)
    assert decode_graph_ops("refine_selection") == len(model.model.layers)  # every layer refines
    assert cache.path_counts()["gather_sites"] == 4 * len(model.model.layers)
    gathered, _ = compiled_steps(model, ids, 4, candidates=6.75, **SMALL_WINDOW)  # 54 of 55 slots
    torch.testing.assert_close(every, gathered, atol=1e-5, rtol=1e-5)
    shared, _ = compiled_steps(model, ids, 4, **SMALL_WINDOW)
    assert (every - shared).abs().max() > 1e-6  # another selection (a random tiny model: small logit moves)


def test_candidates_inf_options():
    from specontext_compile.config import ALL_TOKENS

    assert sc.SpeContextConfig(budget=64, candidates=math.inf).prefetch_tokens == ALL_TOKENS
    with pytest.raises(ValueError, match="candidates=inf"):
        sc.SpeContextConfig(candidates=math.inf, device_memory_bytes=1 << 30)
