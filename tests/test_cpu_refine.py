"""Our CPU kernel for a refined site (runtime/cpu_refine.py, csrc/refine_attention.cpp): values
against a float64 refinement and attention, equality with the torch body it replaces, which
sites it serves, and the compiled default step that calls it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime import aten_step, cpu_kernels, cpu_refine, cpu_selection, page_bounds, routes
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from test_backend_e2e import decode_logits
from torch.fx.experimental.proxy_tensor import make_fx

import specontext_compile as sc

pytestmark = pytest.mark.skipif(not cpu_refine.available(), reason="no C++ compiler to build the CPU kernel")


def _reference(query, keys, values, candidates, length, visible, budget, sinks, recent):
    """float64 refinement and attention, one query row per head (aten_step.ranked and
    attend_kept's rules); also returns each (batch row, KV head)'s gap between the last kept
    and the first dropped rank (a near tie there may keep either)."""
    b, num_heads, _, d = query.shape
    num_kv, capacity = keys.shape[1], keys.shape[2]
    g = num_heads // num_kv
    q = query.to(keys.dtype).double().view(b, num_kv, g, d)  # the logits' query in the store's dtype, as the body's
    out = torch.zeros(b, num_kv, g, d, dtype=torch.float64)
    gaps = []
    for i in range(b):
        n = int(length.reshape(-1)[i if length.numel() > 1 else 0])
        for h in range(num_kv):
            cand = candidates[i, h]
            valid = cand >= 0
            safe = cand.clamp(0, capacity - 1)
            ok = valid & (cand < n)
            if visible is not None:
                ok = ok & visible.reshape(-1, capacity)[i if visible.numel() > capacity else 0][safe]
            logits = (q[i, h] @ keys[i, h, safe].double().T).masked_fill(~ok, float("-inf"))  # [g, N]
            probs = torch.softmax(logits, -1).nan_to_num(0.0)
            rank = torch.where(valid, probs.amax(0), float("-inf"))
            forced = valid & ((valid.cumsum(0) <= sinks) | (ok & (cand >= n - recent)))
            rank = torch.where(forced, float("inf"), rank)
            kept = min(budget, int(valid.sum()))
            order = rank.sort(descending=True).values
            if 0 < kept < int(valid.sum()) and order[kept] > 0:  # a tie among weightless slots changes nothing
                gaps.append(float(order[kept - 1] - order[kept]))
            top = rank.topk(kept).indices
            kept_logits = logits[:, top]
            w = torch.softmax(kept_logits, -1).nan_to_num(0.0)
            out[i, h] = w @ values[i, h, safe[top]].double()
    return out.view(b, num_heads, 1, d), min(gaps) if gaps else 1.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), num_kv=st.integers(1, 3), groups=st.sampled_from([1, 3, 4, 6, 7, 8]),
       capacity=st.integers(1, 300), d=st.sampled_from([8, 64, 72, 128]), slots=st.integers(1, 200),
       budget=st.integers(1, 64), sinks=st.integers(0, 4), recent=st.integers(0, 8), hide=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_kernel_equals_float64_refinement(seed, b, num_kv, groups, capacity, d, slots, budget, sinks, recent, hide,
                                          dtype, data):
    """Any group size, head_dim, store and candidate count (repeats none, ``-1`` anywhere,
    positions past the written length), budget above or below the candidates, sinks and recent
    window, hidden slots, float32, bfloat16 or float16 stores: within 3e-5 of float64 over the stores'
    own values, unless two ranks at the budget's edge are within 1e-6 (then either may be kept)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, num_kv * groups, 1, d, generator=gen) * 0.3
    keys, values = (torch.randn(b, num_kv, capacity, d, generator=gen).to(dtype) for _ in range(2))
    slots = min(slots, capacity)
    candidates = torch.stack([torch.randperm(capacity, generator=gen)[:slots] for _ in range(b * num_kv)])
    candidates = torch.where(torch.rand(candidates.shape, generator=gen) < 0.2, -1, candidates)
    candidates = candidates.view(b, num_kv, slots)
    length = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=b, max_size=b)))
    visible = (torch.rand(b, capacity, generator=gen) > 0.3) if hide else None
    recent = min(recent, budget)
    sinks = min(sinks, budget - recent)
    got = cpu_refine.cpu_refine_attention(query, keys, values, candidates, length, visible, None, None, None,
                                          None, None, budget, sinks, recent)
    want, gap = _reference(query, keys, values, candidates, length, visible, budget, sinks, recent)
    if gap < 1e-6:
        return  # a near tie at the budget's edge: either slot is a correct refinement
    torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=3e-5)


def _bounds_at(keys, length, page_tokens, shift, pages):
    """Per-page key bounds over each row's written slots (page ``p`` of row ``b`` holds positions
    ``p * page_tokens - shift[b]`` onwards); a page with none written keeps 0, as a new store's."""
    b, num_kv, capacity, d = keys.shape
    lo = torch.zeros(b, num_kv, pages, d, dtype=keys.dtype)
    hi = torch.zeros_like(lo)
    for i in range(b):
        n = int(length.reshape(-1)[i if length.numel() > 1 else 0])
        for p in range(pages):
            first = p * page_tokens - int(shift[i])
            rows = keys[i, :, max(first, 0):min(first + page_tokens, n, capacity)]
            if rows.shape[1]:
                lo[i, :, p], hi[i, :, p] = rows.amin(1), rows.amax(1)
    return lo, hi


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), num_kv=st.integers(1, 3), groups=st.sampled_from([1, 3, 4, 6, 7, 8]),
       capacity=st.integers(8, 400), page_tokens=st.sampled_from([1, 4, 16]), slots=st.integers(1, 40),
       rescue=st.integers(1, 20), budget=st.integers(1, 48), shifted=st.booleans(), hide=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), d=st.sampled_from([16, 64, 128]), data=st.data())
def test_the_kernels_page_rescue_equals_the_torch_union(seed, b, num_kv, groups, capacity, page_tokens, slots, rescue,
                                                        budget, shifted, hide, dtype, d, data):
    """The kernel's own page rescue (Quest bounds, the best pages, their usable tokens that are
    not candidates yet) gives what the kernel gives over the torch body's union
    (page_bounds.page_scores and rescued_candidates): any page size, row shifts, hidden slots,
    more pages asked than exist, unless two page bounds at the rescue's edge are within 1e-5.
    Head size 64 with 3 or 4 query heads a KV head runs the kernel's vectorised page bounds (16
    pages at a time, then the rest one by one), 16 its generic loop."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, num_kv * groups, 1, d, generator=gen).to(dtype)
    keys, values = (torch.randn(b, num_kv, capacity, d, generator=gen).to(dtype) for _ in range(2))
    length = torch.tensor(data.draw(st.lists(st.integers(1, capacity), min_size=b, max_size=b)))
    shift = torch.tensor([data.draw(st.integers(0, page_tokens - 1)) if shifted else 0 for _ in range(b)])
    pages = page_bounds.page_count(capacity, page_tokens)
    lo, hi = _bounds_at(keys, length, page_tokens, shift, pages)
    slots = min(slots, capacity)
    sel = torch.stack([torch.randperm(capacity, generator=gen)[:slots].sort().values for _ in range(b * num_kv)])
    sel = torch.where(sel < length.repeat_interleave(num_kv).view(-1, 1), sel, -1).sort(-1).values
    sel = sel.view(b, num_kv, slots)
    visible = (torch.rand(b, capacity, generator=gen) > 0.2) if hide else None
    mask = None if visible is None else visible.view(b, 1, 1, capacity)
    seen = aten_step.seen_positions(length, mask, capacity, 1, 0, torch.device("cpu"))
    scores = page_bounds.page_scores(query, lo, hi, seen, 0.25, page_tokens, shift)
    top = scores.sort(-1, descending=True).values
    r = min(rescue, pages)
    if r < pages and torch.isfinite(top[..., r]).any():
        edge = (top[..., r - 1] - top[..., r]).abs()
        if (torch.isfinite(top[..., r]) & (edge < 1e-5)).any():
            return  # a near tie among the pages at the rescue's edge: either is a correct rescue
    union = page_bounds.rescued_candidates(sel, scores, seen, r, page_tokens, shift)
    budget = min(budget, union.shape[-1])
    q = query.float() * 0.25
    got = cpu_refine.cpu_refine_attention(q, keys, values, sel, length, visible, lo, hi, shift, None, None, budget,
                                          0, 1, rescue, page_tokens)
    want = cpu_refine.cpu_refine_attention(q, keys, values, union, length, visible, None, None, None, None, None,
                                           budget, 0, 1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _spec(budget=64, slots=64, rescue=128, sinks=4, recent=8):
    return StepSpec(budget=budget, candidate_slots=slots, sink_tokens=sinks, recent_window=recent,
                    rescue_tokens=rescue, page_tokens=16 if rescue else 0)


def _layer(dtype, capacity=600, num_kv=3, groups=3, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, num_kv * groups, 1, d, generator=gen).to(dtype)
    keys, values = (torch.randn(1, num_kv, capacity, d, generator=gen).to(dtype) for _ in range(2))
    candidates = torch.stack([torch.randperm(capacity - 10, generator=gen)[:64].sort().values for _ in range(num_kv)])
    return query, keys, values, candidates.view(1, num_kv, 64)


def _bounds(keys, length, page_tokens=16):
    """The store's per-page key bounds over its written slots, as the runtime keeps them."""
    b, num_kv, capacity, d = keys.shape
    pages = -(-capacity // page_tokens)
    padded = torch.full((b, num_kv, pages * page_tokens, d), float("nan"), dtype=torch.float32)
    padded[:, :, :length] = keys[:, :, :length].float()
    view = padded.view(b, num_kv, pages, page_tokens, d)
    return view.nan_to_num(float("inf")).amin(3).to(keys.dtype), view.nan_to_num(float("-inf")).amax(3).to(keys.dtype)


def _traced(query, store, candidates, length, mask, spec, pages, fused=True, **variant):
    """The fused body traced as inductor gets it: the variant as the lowering leaves it, the
    spec with the pass's kernel decision (``routes.cpu_kernel``) for these values."""
    var = AttentionVariant(0.125, fused_products=fused, **variant)  # as the lowering leaves it for inductor
    spec = dataclasses.replace(spec, compiled=fused)
    spec = dataclasses.replace(spec, cpu_kernel=routes.cpu_kernel(query, store, mask, spec, var, dense=False,
                                                                  slots=candidates.shape[-1], pages=tuple(pages)))
    return make_fx(lambda q, k, v, c, n, m, *p: aten_step.refine_and_attend(q, (k, v), c, n, m, spec, var, list(p)))(
        query, *store, candidates, length, mask, *pages)


def _calls_kernel(gm) -> bool:
    return any(n.target is torch.ops.specontext.cpu_refine_attention.default for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_traced_refined_site_calls_the_kernel_and_equals_the_torch_body(dtype, monkeypatch):
    """A refined decode site with the page rescue (the default's), traced as the lowering leaves
    it for inductor: the kernel, equal to the torch body it replaces, traced the same way (the
    body's bfloat16 path rounds its weights and output to bfloat16: tolerance of that rounding)."""
    query, keys, values, candidates = _layer(dtype)
    length = torch.tensor(590)
    page_min, page_max = _bounds(keys, 590)
    pages = [page_min, page_max, torch.zeros(1, dtype=torch.long)]
    mask = (torch.arange(600) >= 3).view(1, 1, 1, 600)  # left padding: 3 hidden slots
    for m in (None, mask):
        gm = _traced(query, (keys, values), candidates, length, m, _spec(), pages)
        assert _calls_kernel(gm)
        with monkeypatch.context() as patch:
            patch.setattr(cpu_refine, "applies", lambda *a, **k: False)
            body = _traced(query, (keys, values), candidates, length, m, _spec(), pages)
        assert not _calls_kernel(body)
        want = body(query, keys, values, candidates, length, m, *pages)
        got = gm(query, keys, values, candidates, length, m, *pages)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_kernel_is_not_traced_where_it_does_not_apply(monkeypatch):
    """Soft cap, sliding window, an additive mask or one per head, two query rows, stores of
    another dtype than the query's, a query that needs a gradient, or the library unavailable:
    the torch body, no kernel call."""
    query, keys, values, candidates = _layer(torch.float32)
    length = torch.tensor(590)
    page_min, page_max = _bounds(keys, 590)
    pages = [page_min, page_max, torch.zeros(1, dtype=torch.long)]
    store = (keys, values)
    assert not _calls_kernel(_traced(query, store, candidates, length, None, _spec(), pages, soft_cap=30.0))
    assert not _calls_kernel(_traced(query, store, candidates, length, None, _spec(), pages, sliding_window=128))
    assert not _calls_kernel(_traced(query, store, candidates, length, torch.zeros(1, 1, 1, 600), _spec(), pages))
    per_head = torch.ones(1, 9, 1, 600, dtype=torch.bool)
    assert not _calls_kernel(_traced(query, store, candidates, length, per_head, _spec(), pages))
    two_rows = torch.cat([query, query], dim=2)
    assert not _calls_kernel(_traced(two_rows, store, candidates, length, None, _spec(), pages))
    half = [t.half() for t in (keys, values)]
    assert not _calls_kernel(_traced(query, tuple(half), candidates, length, None, _spec(),
                                     [page_min.half(), page_max.half(), pages[2]]))
    variant = AttentionVariant(0.125, fused_products=True)
    assert cpu_refine.applies(query, store, candidates.shape[-1], None, variant)
    with torch.enable_grad():  # the op has no backward (field case grad_enabled_decode_step)
        assert not cpu_refine.applies(query.clone().requires_grad_(), store, candidates.shape[-1], None, variant)
        grad_spec = dataclasses.replace(_spec(), compiled=True)
        assert not routes.cpu_kernel(query.clone().requires_grad_(), store, None, grad_spec, variant, dense=False,
                                     slots=64, pages=tuple(pages))
    monkeypatch.setattr(cpu_refine, "available", lambda: False)
    assert not _calls_kernel(_traced(query, store, candidates, length, None, _spec(), pages))


def test_bad_inputs_are_clear_errors_not_reads_out_of_bounds():
    query, keys, values, candidates = _layer(torch.float32, capacity=100)
    n = torch.tensor(90)
    with pytest.raises(ValueError, match="candidates must be int64"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates.int(), n, None, None, None, None, None, None, 8, 0, 1)
    with pytest.raises(ValueError, match="candidates must be int64"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates[:, :2], n, None, None, None, None, None, None, 8, 0, 1)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates, n, None, None, None, None, None, None, 0, 0, 1)
    with pytest.raises(ValueError, match="one query row"):
        cpu_refine.cpu_refine_attention(torch.cat([query, query], 2), keys, values, candidates, n, None, None, None, None, None, None, 8, 0, 1)
    lo = torch.zeros(1, 3, 8, 64)
    with pytest.raises(ValueError, match="page_max must be"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates, n, None, lo, lo[:, :2], None, None, None, 8, 0,
                                        1, 4, 16)
    with pytest.raises(ValueError, match="page_min must be"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates, n, None, lo.bfloat16(), lo, None, None, None, 8,
                                        0, 1, 4, 16)
    with pytest.raises(ValueError, match="needs page_min and page_max"):
        cpu_refine.cpu_refine_attention(query, keys, values, candidates, n, None, None, None, None, None, None, 8, 0,
                                        1, 4, 16)
    far = candidates.clone()
    far[0, 0, 0] = 10**9  # a position past the store: never read, never kept as a visible slot
    got = cpu_refine.cpu_refine_attention(query, keys, values, far, n, None, None, None, None, None, None, 8, 0, 1)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_the_compiled_default_step_runs_our_kernels_with_the_torch_bodies_logits(monkeypatch, dtype):
    """The default options' step (a budget below the context, the page rescue on), compiled by
    inductor on CPU: each decode step's refined sites run our refine kernel and its selection
    our selection kernel (their counters: one call per layer, one per step), and the logits
    equal those of the same step compiled with the torch bodies (both ``applies`` patched
    False; the compile caches off for it, since they key on our sources and options, not on a
    patched function). A float16 model too (slow tier): the same kernels, float32 inside
    (the torch bodies round logits and weights to float16: a tolerance of that rounding)."""
    model = tiny_llama().to(dtype)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    names = ("cpu_kernel_refine_calls", "cpu_kernel_selection_calls")

    def run():
        compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8, "page_rescue": 16})
        return decode_logits(model, compiled, ids, 4, sc.SpeContextCache(model.config, max_cache_len=64))

    before = [cpu_kernels.kernel_calls()[n] for n in names]  # Python and C++ operator kernels
    got = run()
    calls = [cpu_kernels.kernel_calls()[n] - b for n, b in zip(names, before)]
    assert calls == [4 * model.config.num_hidden_layers, 4]
    torch._dynamo.reset()
    for module in (cpu_refine, cpu_selection):
        monkeypatch.setattr(module, "applies", lambda *a, **k: False)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        want = run()
    assert [cpu_kernels.kernel_calls()[n] - b for n, b in zip(names, before)] == calls  # the torch bodies: no more calls
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_output_is_the_same_on_any_number_of_threads(dtype):
    """The kernel's phases run without barriers: a thread takes the next unit of a phase whose
    item is ready (csrc/refine_attention.cpp, run_phase). On 1 thread, on 2, and on more threads
    than the items' units of some phases (5 threads, 6 items, one rescue and one cut per item),
    its output is bit for bit the same (the splits are fixed by the shapes, not the threads)
    and matches the float64 reference; the page rescue on (its pages' bounds vectorised at head
    size 64)."""
    gen = torch.Generator().manual_seed(7)
    b, kv, group, capacity, dim, page_tokens = 2, 3, 3, 1024, 64, 16
    query = torch.randn(b, kv * group, 1, dim, generator=gen) * dim ** -0.5
    keys, values = (torch.randn(b, kv, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    candidates = torch.stack([torch.randperm(capacity, generator=gen)[:200].sort().values
                              for _ in range(b * kv)]).view(b, kv, 200)
    length = torch.tensor([capacity, 700])
    candidates = torch.where(candidates < length.view(b, 1, 1), candidates, -1).sort(-1).values
    pages = capacity // page_tokens
    page_min = keys.view(b, kv, pages, page_tokens, dim).amin(3).contiguous()
    page_max = keys.view(b, kv, pages, page_tokens, dim).amax(3).contiguous()
    args = (query, keys, values, candidates, length, None, page_min, page_max, None, None, None, 96, 4, 16, 20, 16)
    threads = torch.get_num_threads()
    calls = cpu_kernels.kernel_calls()["cpu_kernel_refine_calls"]
    dots = cpu_kernels.bf16_dot_calls(cpu_refine._library(), "refine_attention")
    try:
        outputs = []
        for n in (1, 2, 5):
            torch.set_num_threads(n)  # our kernels' OpenMP is torch's (the libraries link its libgomp)
            outputs.append(cpu_refine.cpu_refine_attention(*args))
    finally:
        torch.set_num_threads(threads)
    assert cpu_kernels.kernel_calls()["cpu_kernel_refine_calls"] == calls + 3  # our kernel ran each time
    # bfloat16 keys' logits through the CPU's bfloat16 dot products where it has them
    took_dots = dtype == torch.bfloat16 and cpu_kernels.has_bf16_dot_products()
    assert cpu_kernels.bf16_dot_calls(cpu_refine._library(), "refine_attention") == dots + (3 if took_dots else 0)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    union = cpu_refine.cpu_rescue_candidates(query, keys, candidates, length, None, page_min, page_max, None, 20, 16)
    want, gap = _reference(query, keys, values, union, length, None, 96, 4, 16)
    assert gap > 1e-6  # no near tie at the budget's edge on this seed
    torch.testing.assert_close(outputs[0].double(), want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_that_hides_only_unwritten_slots_is_dropped(dtype):
    """The compiled step passes Hugging Face's decode mask, which hides only the capacity past
    each row's written length: the kernel then runs its mask-free paths (csrc/cpu_common.h,
    needed_mask; counted), and its output is bit for bit the output without a mask, page rescue
    on. A mask that hides one written slot is kept (not counted) and that slot is never
    attended: the float64 reference with that mask."""
    gen = torch.Generator().manual_seed(11)
    b, kv, group, capacity, dim, page_tokens = 2, 3, 3, 1024, 64, 16
    query = torch.randn(b, kv * group, 1, dim, generator=gen) * dim ** -0.5
    keys, values = (torch.randn(b, kv, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    length = torch.tensor([1000, 700])
    candidates = torch.stack([torch.randperm(capacity, generator=gen)[:200].sort().values
                              for _ in range(b * kv)]).view(b, kv, 200)
    candidates = torch.where(candidates < length.view(b, 1, 1), candidates, -1).sort(-1).values
    pages = capacity // page_tokens
    page_min = keys.view(b, kv, pages, page_tokens, dim).amin(3).contiguous()
    page_max = keys.view(b, kv, pages, page_tokens, dim).amax(3).contiguous()
    written = torch.arange(capacity) < length.view(b, 1)  # [batch, capacity]: Hugging Face's decode mask

    def run(visible, rescue=20):
        return cpu_refine.cpu_refine_attention(query, keys, values, candidates, length, visible, page_min, page_max,
                                               None, None, None, 96, 4, 16, rescue, page_tokens)

    lib = cpu_refine._library()
    before = cpu_kernels.masks_dropped(lib, "refine_attention")
    plain = run(None)
    assert cpu_kernels.masks_dropped(lib, "refine_attention") == before  # no mask: nothing to drop
    assert torch.equal(run(written), plain)
    assert cpu_kernels.masks_dropped(lib, "refine_attention") == before + 1
    hidden = written.clone()
    first = int(candidates[1, 2][candidates[1, 2] >= 0][0])  # row 1's first candidate: a sink, always kept
    hidden[1, first] = False
    got = run(hidden, rescue=0)
    assert cpu_kernels.masks_dropped(lib, "refine_attention") == before + 1  # kept
    want, gap = _reference(query, keys, values, candidates, length, hidden, 96, 4, 16)
    assert gap > 1e-6
    torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=3e-5)
    assert not torch.equal(got[1], run(None, rescue=0)[1])
