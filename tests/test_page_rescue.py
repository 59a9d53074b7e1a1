"""The page rescue of the two-stage selection (option ``page_rescue``, issue 12): per-page key
bounds kept by the KV store, Quest's bound under each layer's own query, the rescued candidate
set, and the backend path — values against float64 / by-hand references, the path that ran
asserted by its counters, negative tests where it must stay off."""

from __future__ import annotations

import dataclasses
import logging

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from specontext_compile.runtime import aten_step, page_bounds, sparse_attention
from specontext_compile.runtime.kv_cache import SpeContextLayer
from _tiny import compiled_steps, decode_graph_ops
from specontext_compile.backend import clear_compile_reports
from test_two_stage import _refine_reference

import specontext_compile as sc
from specontext_compile.tiny_models import tiny_family
from specontext_compile.runtime.spec import AttentionVariant, StepSpec


def _bounds_by_hand(keys: torch.Tensor, length: int, page_tokens: int, pages: int):
    """float64 per-page min / max of the written keys ``[b, kv, length, d]``; 0 for empty pages."""
    b, kv, _, d = keys.shape
    lo = torch.zeros(b, kv, pages, d, dtype=torch.float64)
    hi = torch.zeros(b, kv, pages, d, dtype=torch.float64)
    for p in range(pages):
        seg = keys[:, :, p * page_tokens: min((p + 1) * page_tokens, length)].double()
        if seg.shape[2]:
            lo[:, :, p], hi[:, :, p] = seg.amin(2), seg.amax(2)
    return lo, hi


def _assert_bounds(layer: SpeContextLayer) -> None:
    n = int(layer.cumulative_length)
    lo, hi = _bounds_by_hand(layer.keys, n, layer.page_tokens, layer.page_min.shape[2])
    assert torch.equal(layer.page_min.double(), lo) and torch.equal(layer.page_max.double(), hi)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), page_tokens=st.sampled_from([1, 4, 16]), chunk=st.integers(5, 40),
       writes=st.lists(st.integers(1, 20), min_size=1, max_size=6), crop=st.integers(0, 12),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_store_keeps_exact_page_bounds_through_writes_growth_and_cache_operations(seed, page_tokens, chunk, writes,
                                                                                  crop, dtype):
    """After any sequence of writes (prefill-sized and one-token, across growth of the store),
    a crop, a beam reorder, a batch selection and a reset, ``page_min``/``page_max`` equal the
    per-page min / max of exactly the written keys (0 for a page with none)."""
    g = torch.Generator().manual_seed(seed)
    layer = SpeContextLayer(chunk_tokens=chunk, page_tokens=page_tokens)

    def write(n):
        layer.update(torch.randn(2, 3, n, 8, generator=g).to(dtype), torch.randn(2, 3, n, 8, generator=g).to(dtype))

    for n in writes:
        write(n)
        _assert_bounds(layer)
    layer.crop(-min(crop, int(layer.cumulative_length)))
    _assert_bounds(layer)
    write(3)
    _assert_bounds(layer)
    layer.reorder_cache(torch.tensor([1, 1]))
    _assert_bounds(layer)
    layer.batch_select_indices(torch.tensor([0]))
    _assert_bounds(layer)
    layer.reset()
    layer.update(torch.randn(1, 3, 2, 8, generator=g).to(dtype), torch.randn(1, 3, 2, 8, generator=g).to(dtype))
    _assert_bounds(layer)


def test_cache_page_tokens_option():
    model = tiny_family("llama", "sdpa")
    assert sc.SpeContextCache(model.config, page_tokens=0).kv_layers[0].page_tokens == 0
    with pytest.raises(ValueError, match="page_tokens"):
        sc.SpeContextCache(model.config, page_tokens=-1)
    layer = sc.SpeContextCache(model.config, page_tokens=0).kv_layers[0]
    layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    assert layer.page_min is None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), groups=st.sampled_from([1, 3]), q_len=st.sampled_from([1, 2]),
       length=st.integers(3, 45), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_page_scores_bound_every_logit_of_the_page(seed, groups, q_len, length, dtype):
    """Quest's bound (section 3.2) is an upper bound: per KV head, a page's score is at least
    the float64 logit of any query head of the group and row on any written token of the
    page, and equals the float64 formula ``sum_c max(q_c min_c, q_c max_c)`` (group max);
    pages no row sees score ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    b, kv, d, cap, page = 2, 2, 8, 48, 4
    keys = (torch.randn(b, kv, cap, d, generator=g) * 3).to(dtype)
    query = (torch.randn(b, kv * groups, q_len, d, generator=g) * 3).to(dtype)
    pages = page_bounds.page_count(cap, page)
    lo = torch.zeros(b, kv, pages, d, dtype=dtype)
    hi = torch.zeros(b, kv, pages, d, dtype=dtype)
    page_bounds.update_page_bounds(keys, lo, hi, torch.tensor(length), length, page)
    length_t = torch.tensor(length)
    seen = aten_step.seen_positions(length_t, None, cap, q_len, 0, keys.device)
    scores = page_bounds.page_scores(query, lo, hi, seen, 0.5, page)
    q = query.double().view(b, kv, groups * q_len, d) * 0.5
    formula = torch.maximum(q[:, :, :, None] * lo.double()[:, :, None], q[:, :, :, None] * hi.double()[:, :, None])
    formula = formula.sum(-1).amax(2)
    written = pages if length >= cap else -(-length // page)
    torch.testing.assert_close(scores[..., :written].double(), formula[..., :written], atol=1e-4, rtol=1e-5)
    assert torch.isneginf(scores[..., written:]).all()
    logits = q @ keys.double()[..., :length, :].transpose(-1, -2)  # [b, kv, g*q, length]
    best = torch.nn.functional.pad(logits.amax(2), (0, written * page - length), value=float("-inf"))
    assert (scores[..., :written].double() >= best.view(b, kv, written, page).amax(-1) - 1e-4).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(3, 20), rescue=st.integers(1, 6), pads=st.integers(0, 9),
       shifted=st.booleans())
def test_rescued_candidates_are_the_union_with_the_best_seen_pages(seed, slots, rescue, pads, shifted):
    """The rescued set is exactly candidates ∪ (seen tokens of the top-``rescue`` pages by
    score, each row's pages shifted to start at its first real token or not): the candidates
    first, unchanged, then the rescued tokens, no position twice; a pad is never rescued."""
    g = torch.Generator().manual_seed(seed)
    b, kv, cap, page, length = 2, 2, 40, 4, 37
    visible = torch.ones(b, 1, cap, dtype=torch.bool)
    visible[0, 0, :pads] = False
    seen = visible & (torch.arange(cap) < length)
    shift = page_bounds.row_shift(torch.tensor([pads, 0]), page) if shifted else None
    pages = page_bounds.page_count(cap, page)
    pos = page_bounds.page_positions(pages, page, shift, b, "cpu")  # [b, 1, pages, page]
    inside = (pos >= 0) & (pos < cap)
    page_seen = (seen.expand(b, 1, cap).gather(-1, pos.clamp(0, cap - 1).view(b, 1, -1)).view(pos.shape)
                 & inside).any(-1)
    scores = torch.where(page_seen, torch.randn(b, kv, pages, generator=g), float("-inf"))
    cand = []
    for i in range(b):
        allowed = seen[i, 0].nonzero().flatten()
        rows = [allowed[torch.randperm(len(allowed), generator=g)[:slots]].sort().values for _ in range(kv)]
        cand.append(torch.stack([torch.nn.functional.pad(r, (slots - len(r), 0), value=-1) for r in rows]))
    cand = torch.stack(cand)
    n = min(rescue, int(page_seen.sum(-1).min()))
    out = page_bounds.rescued_candidates(cand, scores, seen, n, page, shift)
    assert out.shape == (b, kv, slots + n * page)
    for i in range(b):
        for k in range(kv):
            top = scores[i, k].topk(n).indices.tolist()
            want = {int(p) for p in cand[i, k] if p >= 0}
            want |= {int(pos[i, 0, p, t]) for p in top for t in range(page)
                     if bool(inside[i, 0, p, t]) and bool(seen[i, 0, pos[i, 0, p, t]])}
            row = out[i, k].tolist()
            valid = [p for p in row if p >= 0]
            assert sorted(valid) == sorted(want) and len(valid) == len(set(valid))  # no position twice
            assert row[:slots] == cand[i, k].tolist()  # the candidates first, unchanged (their sinks lead)
            assert all(p >= (pads if i == 0 else 0) for p in valid)


def test_row_shift_starts_a_page_at_the_first_real_token():
    for pads in range(40):
        shift = page_bounds.row_shift(torch.tensor([pads]), 16)
        pos = page_bounds.page_positions(page_bounds.page_count(64, 16), 16, shift, 1, "cpu")
        assert pads in pos[0, 0, :, 0].tolist()  # some page starts exactly there


def test_refine_with_rescue_keeps_the_layers_top_budget_of_the_union():
    """A layer whose current query points at tokens the candidates missed: with the rescue it
    keeps the float64 top ``budget`` of candidates ∪ rescued pages (by hand), and the missed
    tokens are among them; without it they cannot be."""
    g = torch.Generator().manual_seed(3)
    b, kv, groups, d, cap, page, length, budget = 1, 2, 2, 16, 64, 4, 60, 8
    keys = torch.randn(b, kv, cap, d, generator=g)
    query = torch.randn(b, kv * groups, 1, d, generator=g)
    target = torch.arange(20, 24)  # page 5: keys aligned with every query head of the group
    for k in range(kv):
        keys[0, k, target] = query[0, k * groups: (k + 1) * groups, 0].mean(0) * 4
    lo = torch.zeros(b, kv, cap // page, d)
    hi = torch.zeros_like(lo)
    page_bounds.update_page_bounds(keys, lo, hi, torch.tensor(length), length, page)
    base = torch.tensor([0, 1, 30, 33, 40, 41, 44, 50, 52, 56, 57, 58, 59])  # misses page 5
    cand = base.expand(b, kv, -1).clone()
    scale = d ** -0.5
    length_t = torch.tensor(length)
    spec = StepSpec(budget, budget, sink_tokens=1, recent_window=2)
    plain, _ = aten_step.refine_coverage(query, keys, cand, length_t, None, spec, AttentionVariant(scale))
    assert not set(target.tolist()) & set(plain.flatten().tolist())
    rescue = dataclasses.replace(spec, rescue_tokens=2 * page, page_tokens=page)
    kept, _ = aten_step.refine_coverage(query, keys, cand, length_t, None, rescue, AttentionVariant(scale),
                                        pages=(lo, hi, None))
    seen = aten_step.seen_positions(length_t, None, cap, 1, 0, keys.device)
    union = page_bounds.rescued_candidates(cand, page_bounds.page_scores(query, lo, hi, seen, scale, page), seen, 2,
                                           page)
    want, _, _ = _refine_reference(query, keys, union, length, scale, budget, 1, 2)
    assert kept.sort(-1).values.tolist() == want  # a set: the refinement keeps no order
    assert set(target.tolist()) <= set(kept[0, 0].tolist())


@pytest.mark.slow
def test_compiled_rescue_step_equals_the_eager_op_chain_and_counts_its_sites():
    """Inductor (rescue lowered to aten) == eager ops; ``page_rescue_sites`` counts every
    layer of every step, and the refinement runs even at ``candidates=1``."""
    model = tiny_family("llama", "sdpa")
    layers = len(model.model.layers)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    opts = dict(budget=12, page_rescue=16, sink_tokens=1, recent_window=2)
    clear_compile_reports()
    eager, c_eager = compiled_steps(model, ids, 4, inner="eager", lower=False, **opts)
    assert decode_graph_ops("refine_selection") == layers
    compiled, c_ind = compiled_steps(model, ids, 4, **opts)
    torch.testing.assert_close(compiled, eager, atol=2e-4, rtol=0)
    assert c_ind.path_counts() == c_eager.path_counts()
    assert c_ind.path_counts()["page_rescue_sites"] == 4 * layers
    plain, _ = compiled_steps(model, ids, 4, inner="eager", budget=12, sink_tokens=1, recent_window=2)
    assert (plain - eager).abs().max() > 1e-4  # the rescue changed what the layers read


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_rescue_of_every_page_is_each_layers_exact_top_budget(inner):
    """A rescue of more pages than the store holds brings every position the layer sees into
    its ranking: the same logits as candidates=inf (each layer's exact top budget). On the op
    chain in the fast tier; the default step's twin (about 70 s of new inductor kernels) is
    slow, the default step's rescue being counted in the fast tier by test_decode_step.py's
    default-graph test (``page_rescue_sites``)."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    wide, cache = compiled_steps(model, ids, 3, inner=inner, budget=8, page_rescue=4096, recent_window=2)
    assert cache.path_counts()["page_rescue_sites"] == 3 * len(model.model.layers)
    exact, cache = compiled_steps(model, ids, 3, inner=inner, budget=8, candidates=float("inf"), recent_window=2)
    assert cache.path_counts()["gather_sites"] == 3 * len(model.model.layers)
    torch.testing.assert_close(wide, exact, atol=1e-5, rtol=0)


# the fast tier: pad 15 on the op chain; the default step's cases (~90 s of inductor compiles
# each: a padded and an unpadded graph) and the other pads are the slow tier's
@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("pad", [15, pytest.param(16, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_left_padded_row_with_rescue_decodes_as_the_prompt_alone(pad, inner):
    """No pad is rescued, a row's sinks stay its first real tokens, and its pages start at its
    first real token (``page_shift_from_mask``): a left-padded row gives the same logits as its
    prompt alone with the rescue on and a budget far below the context, whatever the pad count
    (a multiple of the page size or not)."""
    from test_two_stage import padded_and_alone

    model = tiny_family("llama", "sdpa")
    padded, alone, counts, alone_counts = padded_and_alone(
        model, pad, 41 - pad, budget=10, recent_window=3, sink_tokens=2, page_rescue=16, inner=inner)
    layers = len(model.model.layers)
    assert counts["page_rescue_sites"] == counts["gather_sites"] == 5 * layers, counts  # 5 decode steps
    assert alone_counts["page_rescue_sites"] == 5 * layers, alone_counts
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=0)


def test_no_rescue_where_the_store_keeps_no_bounds(caplog):
    """A cache built with ``page_tokens=0`` emits no bounds: the rewrite refines nothing at
    candidates=1 (no refinement in the decode graph), counts no rescued site and logs why."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(budget=8, page_rescue=16,
                                                                              inner="eager"))
    cache = sc.SpeContextCache(model.config, max_cache_len=60, page_tokens=0)
    clear_compile_reports()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="specontext_compile.passes.sparse_rewrite"):
        out = forward(input_ids=ids, cache=cache, use_cache=True)
        forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert decode_graph_ops("refine_selection") == 0
    assert cache.path_counts()["gather_sites"] == len(model.model.layers)
    assert cache.path_counts()["page_rescue_sites"] == 0
    assert "page_rescue is off" in caplog.text


def test_rescue_layers_rescue_those_layers_and_leave_the_others_on_the_shared_selection():
    """Option ``rescue_layers``: only the named layers (negative from the end) refine with the
    rescue. Naming none is ``page_rescue=0`` bit for bit, naming every layer is the default
    (None) bit for bit, naming one layer changes the logits; the counters say how many sites
    rescued and that every site still gathered."""
    model = tiny_family("llama", "sdpa")
    layers = len(model.model.layers)
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(11))
    opts = dict(budget=8, recent_window=2, sink_tokens=1, inner="eager")
    rescued_all, c_all = compiled_steps(model, ids, 3, page_rescue=16, **opts)
    plain, c_plain = compiled_steps(model, ids, 3, page_rescue=0, **opts)
    none_named, c_none = compiled_steps(model, ids, 3, page_rescue=16, rescue_layers=(), **opts)
    first_only, c_first = compiled_steps(model, ids, 3, page_rescue=16, rescue_layers=-layers, **opts)
    every, _ = compiled_steps(model, ids, 3, page_rescue=16, rescue_layers=tuple(range(layers)), **opts)
    torch.testing.assert_close(every, rescued_all, atol=0, rtol=0)
    assert c_all.path_counts()["page_rescue_sites"] == 3 * layers
    assert c_none.path_counts()["page_rescue_sites"] == c_plain.path_counts()["page_rescue_sites"] == 0
    assert c_first.path_counts()["page_rescue_sites"] == 3  # layer 0 (named as -layers), once per step
    assert c_first.path_counts()["gather_sites"] == 3 * layers
    torch.testing.assert_close(none_named, plain, atol=0, rtol=0)
    assert (first_only - plain).abs().max() > 1e-4  # layer 0's rescue changed what the model computes
    assert (rescued_all - plain).abs().max() > 1e-4


@pytest.mark.parametrize("bad", [1.5, "0,1", [0, True], {0: 1}])
def test_bad_rescue_layers_name_the_fix(bad):
    with pytest.raises(ValueError, match="rescue_layers.*tuple of ints"):
        sc.SpeContextConfig(rescue_layers=bad)


@pytest.mark.parametrize("bad,match", [
    ({"page_rescue": -1}, "page_rescue"), ({"page_rescue": 1.5}, "page_rescue"), ({"page_rescue": True}, "page_rescue"),
])
def test_bad_page_rescue_options_name_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        sc.SpeContextConfig(**bad)


def test_buffer_tokens_hold_the_candidates_and_the_rescued_pages():
    assert sc.SpeContextConfig(budget=100, candidates=2.0, page_rescue=40).buffer_tokens == 200 + 48  # 3 pages
    assert sc.SpeContextConfig(budget=100, page_rescue=0).buffer_tokens == 100
    assert sc.SpeContextConfig(budget=100).page_rescue == 200  # the default: 2 x budget
    assert sc.SpeContextConfig(budget=100).buffer_tokens == 100 + 208  # 13 pages
    assert sc.SpeContextConfig(budget=100, device_memory_bytes=1 << 30).page_rescue == 200  # on with offload too


def test_page_bound_ops_never_read_a_tensor_value_on_the_host():
    """The bounds update, the page scores and the rescued refinement on the meta device (a host
    read raises there): sync-free, like the rest of the step."""
    meta = torch.device("meta")
    b, h, kv, cap, d, page = 2, 6, 2, 96, 16, 16
    keys = torch.empty(b, kv, cap, d, device=meta)
    lo = torch.empty(b, kv, page_bounds.page_count(cap, page), d, device=meta)
    length = torch.empty((), dtype=torch.long, device=meta)
    shift = torch.empty(b, dtype=torch.long, device=meta)
    mask = torch.empty(b, 1, 1, cap, device=meta)
    page_bounds.shift_from_mask(shift, length, mask, cap, page)
    page_bounds.update_page_bounds(keys, lo, lo.clone(), length, 1, page, shift)
    page_bounds.update_page_bounds(keys, lo, lo.clone(), length, 40, page)
    cand = torch.empty(b, kv, 24, dtype=torch.long, device=meta)
    idx, _ = aten_step.refine_selection(torch.empty(b, h, 1, d, device=meta), keys, cand, length, mask, (lo, lo, shift),
                                        StepSpec(8, 8, sink_tokens=4, recent_window=8, rescue_tokens=2 * page,
                                                 page_tokens=page), AttentionVariant(0.25))
    assert idx.shape == (b, kv, 8)


@pytest.mark.parametrize("family", ["gemma3", "llama", "mistral"])
def test_page_shift_reads_the_padding_of_a_full_attention_site(family):
    """The per-row page shift comes from a full-attention site's mask: gemma3's layer 0 is a
    sliding-window layer (its mask hides more than the padding), yet a row with 15 pads gets
    the shift that starts a page at its 16th position, a row without pads 0; a model whose
    every layer slides (mistral here) sets no shift (0)."""
    model = tiny_family(family, "sdpa")
    g = torch.Generator().manual_seed(9)
    pad = 15
    ids = torch.randint(1, 128, (2, 41), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(budget=10, inner="eager"))
    cache = sc.SpeContextCache(model.config, max_cache_len=48)
    with torch.no_grad():
        forward(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    want = [int(page_bounds.row_shift(torch.tensor(pad), 16)), 0] if family != "mistral" else [0, 0]
    assert cache.page_shift.tolist() == want


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), groups=st.sampled_from([1, 3]), q_len=st.sampled_from([1, 2]),
       budget=st.integers(4, 12), rescue_pages=st.integers(0, 3), pads=st.integers(0, 5),
       soft_cap=st.sampled_from([None, 5.0]), window=st.sampled_from([0, 24]))
def test_refine_and_attend_equals_refine_then_attend(seed, groups, q_len, budget, rescue_pages, pads, soft_cap,
                                                     window):
    """The fused body the lowering uses for a refined site (the logits computed once) gives
    the two bodies' output: refine_selection (page rescue on or off), then sparse_attention
    over what it kept; float32, 1e-5 (the same logits, a softmax over the kept slots)."""
    g = torch.Generator().manual_seed(seed)
    b, kv, d, cap, page, length = 2, 2, 8, 48, 4, 40
    keys = torch.randn(b, kv, cap, d, generator=g)
    values = torch.randn(b, kv, cap, d, generator=g)
    query = torch.randn(b, kv * groups, q_len, d, generator=g)
    lo, hi = torch.zeros(b, kv, cap // page, d), torch.zeros(b, kv, cap // page, d)
    length_t = torch.tensor(length)
    page_bounds.update_page_bounds(keys, lo, hi, length_t, length, page)
    mask = torch.ones(b, 1, q_len, cap, dtype=torch.bool)
    mask[1, ..., :pads] = False  # row 1 left-padded
    scores = torch.rand(b, kv, cap, generator=g)
    visible = sparse_attention.row_visibility(mask, cap)
    cand = aten_step.select_positions(scores, length_t - q_len, q_len, budget + 4, 1, 2, window, visible)
    spec = StepSpec(budget, budget, sink_tokens=1, recent_window=2, rescue_tokens=rescue_pages * page,
                    page_tokens=page)
    variant = AttentionVariant(d ** -0.5, soft_cap, window)
    kept, _ = aten_step.refine_selection(query, keys, cand, length_t, mask, (lo, hi, None), spec, variant)
    want = aten_step.sparse_attention(query, keys, values, kept, length_t, mask, spec, variant)
    got = aten_step.refine_and_attend(query, (keys, values), cand, length_t, mask, spec, variant, (lo, hi, None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 40])
def test_compiled_bounds_update_writes_the_touched_pages_in_place(q_len):
    """Inductor's bounds update equals the eager one (shifted rows included) and writes only the
    touched pages: the generated code has no loop over all of a bound's elements (a scatter_
    was compiled as a copy of the whole bounds, twice per bound, at every layer and step)."""
    from torch._inductor.utils import run_and_get_code

    b, kv, cap, d, page = 2, 3, 1000, 8, 16
    pages = page_bounds.page_count(cap, page)  # 63: 2 * 3 * 63 * 8 = 3024 elements per bound
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(b, kv, cap, d, generator=g)
    length, shift = torch.tensor(700), torch.tensor([0, 5])
    lo, hi = torch.randn(b, kv, pages, d, generator=g), torch.randn(b, kv, pages, d, generator=g)
    want_lo, want_hi = lo.clone(), hi.clone()
    page_bounds.update_page_bounds(keys, want_lo, want_hi, length, q_len, page, shift)
    assert not torch.equal(want_lo, lo)  # the update changed something to compare

    def update(keys, lo, hi, length, shift):
        page_bounds.update_page_bounds(keys, lo, hi, length, q_len, page, shift)

    compiled = torch.compile(update, backend="inductor", fullgraph=True, dynamic=False)
    _, (code,) = run_and_get_code(compiled, keys, lo, hi, length, shift)
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
    assert str(lo.numel()) not in code, "the compiled bounds update copies a whole bound"
