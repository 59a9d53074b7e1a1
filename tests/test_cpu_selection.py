"""Our CPU kernel for the lagged-query head's scores (runtime/cpu_selection.py,
csrc/selection_scores.cpp): values against float64, equality with the torch body it replaces,
which selections it serves (the compiled default step that calls it once per step:
tests/test_cpu_refine.py, with the refine kernel)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime import cpu_kernels, cpu_selection, routes, scorers
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from torch.fx.experimental.proxy_tensor import make_fx

pytestmark = pytest.mark.skipif(not cpu_selection.available(), reason="no C++ compiler to build the CPU kernel")


def _reference(query, stores, length, visible):
    """float64 lagged-query scores: per layer the softmax over written, visible positions, max
    over each group's heads, summed over the layers."""
    _, b, num_heads, _, d = query.shape
    num_kv, capacity = stores[0].shape[1], stores[0].shape[2]
    pos = torch.arange(capacity)
    allowed = pos < length.reshape(-1, 1)  # [b|1, capacity]
    if visible is not None:
        allowed = allowed & visible.reshape(-1, capacity)
    allowed = allowed.view(-1, 1, 1, capacity)
    total = torch.zeros(b, num_kv, capacity, dtype=torch.float64)
    for i, keys in enumerate(stores):
        q = query[i].double().view(b, num_kv, num_heads // num_kv, d)  # the op takes the query as given
        logits = (q @ keys.double().transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        total += torch.softmax(logits, -1).nan_to_num(0.0).amax(2)
    return total


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), layers=st.integers(1, 4), b=st.integers(1, 2), num_kv=st.integers(1, 3),
       groups=st.sampled_from([1, 3, 4, 6, 7, 8]), capacity=st.integers(1, 600), d=st.sampled_from([8, 64, 72, 128]),
       per_row=st.booleans(), hide=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data=st.data())
def test_kernel_equals_float64_scores(seed, layers, b, num_kv, groups, capacity, d, per_row, hide, dtype, data):
    """Any layer count, group size, head_dim, store size, per-row lengths (0: nothing scored),
    hidden positions, float32, bfloat16 or float16 stores: within 2e-6 + 1e-4 relative of float64, 0 past
    the written length."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(layers, b, num_kv * groups, 1, d, generator=gen) * 0.3
    stores = [torch.randn(b, num_kv, capacity, d, generator=gen).to(dtype) for _ in range(layers)]
    if per_row:
        length = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=b, max_size=b)))
    else:
        length = torch.tensor(data.draw(st.integers(0, capacity)))
    visible = (torch.rand(b, capacity, generator=gen) > 0.3) if hide else None
    got = cpu_selection.cpu_selection_scores(query, stores, length, visible)
    torch.testing.assert_close(got.double(), _reference(query, stores, length, visible), atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("rounded", [True, False])
def test_bfloat16_keys_take_the_dot_products_only_with_a_bfloat16_query(rounded):
    """bfloat16 keys' logits go through the CPU's bfloat16 dot products (VDPBF16PS, where it has
    them) when the query holds bfloat16 values, as the step passes it (rounded like the torch
    body); a float32 query the caller did not round keeps the widening path, so the kernel
    takes its query as given either way: within 2e-6 + 1e-4 relative of float64."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 1, 9, 1, 64, generator=gen) * 0.3
    if rounded:
        query = query.bfloat16().float()
    stores = [torch.randn(1, 3, 700, 64, generator=gen).bfloat16() for _ in range(2)]
    length = torch.tensor(650)
    before = cpu_kernels.bf16_dot_calls(cpu_selection._library(), "selection_scores")
    got = cpu_selection.cpu_selection_scores(query, stores, length, None)
    took = cpu_kernels.bf16_dot_calls(cpu_selection._library(), "selection_scores") - before
    assert took == (1 if rounded and cpu_kernels.has_bf16_dot_products() else 0)
    torch.testing.assert_close(got.double(), _reference(query, stores, length, None), atol=2e-6, rtol=1e-4)


def _site(query_state, stores, cached, visible, fused=True, bias=None):
    """The scorer traced as inductor gets it: the variant as the lowering leaves it, the
    kernel as the pass decides it for these values (``routes.selection_kernel``)."""
    variant = AttentionVariant(0.125, fused_products=fused)  # as the lowering leaves it for inductor
    kernel = routes.selection_kernel(query_state, list(stores), StepSpec(8, 8, compiled=fused), bias is not None)
    return make_fx(lambda q, n, *s: scorers.lagged_query_score((q, None), list(s), n, 1, visible, variant, bias,
                                                               kernel))(query_state, cached, *stores)


def _calls_kernel(gm) -> bool:
    return any(n.target is torch.ops.specontext.cpu_selection_scores.default for n in gm.graph.nodes)


def _inputs(dtype, layers=3, capacity=500, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query_state = torch.randn(layers + 1, 1, 9, 1, 64, generator=gen).to(dtype)  # a spare slot, as recorded
    stores = [torch.randn(1, 3, capacity, 64, generator=gen).to(dtype) for _ in range(layers)]
    return query_state, stores, torch.tensor(capacity - 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_traced_selection_calls_the_kernel_and_equals_the_torch_body(dtype, monkeypatch):
    """The lagged-query scores traced as the lowering leaves them for inductor: the kernel, equal
    to the torch body it replaces (traced the same way) to float32 rounding; with left padding."""
    query_state, stores, cached = _inputs(dtype)
    for visible in (None, (torch.arange(500) >= 7).view(1, 1, 500)):
        gm = _site(query_state, stores, cached, visible)
        assert _calls_kernel(gm)
        with monkeypatch.context() as patch:
            patch.setattr(cpu_selection, "applies", lambda *a, **k: False)
            body = _site(query_state, stores, cached, visible)
        assert not _calls_kernel(body)
        torch.testing.assert_close(gm(query_state, cached, *stores), body(query_state, cached, *stores),
                                   atol=1e-6, rtol=1e-4)


def test_the_kernel_is_not_traced_where_it_does_not_apply(monkeypatch):
    """An eager trace (no fused products), ALiBi's bias, MLA's latent pairs, queries of another
    dtype than the stores', or the library unavailable: the torch body, no kernel call."""
    query_state, stores, cached = _inputs(torch.float32)
    assert not _calls_kernel(_site(query_state, stores, cached, None, fused=False))
    assert not _calls_kernel(_site(query_state, stores, cached, None, bias=torch.zeros(1, 9, 1, 500)))
    assert not cpu_selection.applies(query_state, [(s, s[..., :8]) for s in stores])
    half = [s.half() for s in stores]
    assert not _calls_kernel(_site(query_state.bfloat16(), half, cached, None))
    assert not _calls_kernel(_site(query_state.bfloat16(), stores, cached, None))
    monkeypatch.setattr(cpu_selection, "available", lambda: False)
    assert not _calls_kernel(_site(query_state, stores, cached, None))


def test_bad_inputs_are_clear_errors_not_reads_out_of_bounds():
    query_state, stores, cached = _inputs(torch.float32)
    q = query_state[:3].float()
    with pytest.raises(ValueError, match=r"key_stores\[1\]"):
        cpu_selection.cpu_selection_scores(q, [stores[0], stores[1][:, :, :100]], cached, None)
    with pytest.raises(ValueError, match="query must be float32"):
        cpu_selection.cpu_selection_scores(q[:2], stores, cached, None)
    with pytest.raises(ValueError, match="length must be int64"):
        cpu_selection.cpu_selection_scores(q, stores, cached.int(), None)
    with pytest.raises(ValueError, match="visible must be bool"):
        cpu_selection.cpu_selection_scores(q, stores, cached, torch.ones(1, 499, dtype=torch.bool))
    far = cpu_selection.cpu_selection_scores(q, stores, torch.tensor(10**9), None)  # past the store: its capacity
    assert torch.isfinite(far).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), layers=st.integers(1, 4), b=st.integers(1, 2), num_kv=st.integers(1, 3),
       groups=st.sampled_from([1, 3, 7]), capacity=st.integers(1, 600), d=st.sampled_from([8, 64, 72]),
       hide=st.booleans(), data=st.data())
def test_int8_keys_score_as_their_dequantized_rows_in_float64(seed, layers, b, num_kv, groups, capacity, d, hide,
                                                               data):
    """int8 levels with one float32 scale a row (``int8_keys.quantize_rows``): the kernel's scores
    are the float64 scores of the dequantized keys (``level * scale``) and the query rounded
    the same way, within 2e-6 + 1e-4 relative (the kernel scales the levels' dot products), for
    the unrolled shapes (3 x 64: the int8 dot products where the CPU has them) and generic
    ones; the int8 entry's calls are counted."""
    from specontext_compile.runtime import int8_keys
    from specontext_compile.runtime.torch_private import counters

    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(layers, b, num_kv * groups, 1, d, generator=gen) * 0.3
    keys = [torch.randn(b, num_kv, capacity, d, generator=gen) * (1 + 3 * torch.rand(b, num_kv, capacity, 1,
                                                                                    generator=gen))
            for _ in range(layers)]
    rows = [int8_keys.quantize_rows(k) for k in keys]
    length = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=b, max_size=b)))
    visible = (torch.rand(b, capacity, generator=gen) > 0.3) if hide else None
    before = counters["specontext"]["cpu_kernel_selection_int8_calls"]
    got = cpu_selection.cpu_selection_scores(query, [r[0] for r in rows], length, visible, [r[1] for r in rows])
    assert counters["specontext"]["cpu_kernel_selection_int8_calls"] == before + 1
    wide = [levels.double() * scales.double().unsqueeze(-1) for levels, scales in rows]
    q_levels, q_scales = int8_keys.quantize_rows(query)  # the kernel rounds the query's rows the same way
    q_wide = q_levels.double() * q_scales.double().unsqueeze(-1)
    torch.testing.assert_close(got.double(), _reference(q_wide, wide, length, visible), atol=2e-6, rtol=1e-4)


def test_int8_keys_take_the_cpus_int8_dot_products_at_unrolled_shapes():
    """At SmolLM2's shape (3 query heads a KV head, head_dim 64) a CPU with AVX-512 VNNI scores
    int8 keys with its int8 dot products (``int8_dot_calls``), at head_dim 72 the generic loop;
    both equal the float64 scores of the rounded query and keys."""
    from specontext_compile.runtime import int8_keys

    has_vnni = "avx512_vnni" in open("/proc/cpuinfo").read().split()
    for d, fast in ((64, has_vnni), (72, False)):
        gen = torch.Generator().manual_seed(d)
        query = torch.randn(2, 1, 9, 1, d, generator=gen) * 0.2
        rows = [int8_keys.quantize_rows(torch.randn(1, 3, 300, d, generator=gen)) for _ in range(2)]
        before = cpu_selection.int8_dot_calls()
        got = cpu_selection.cpu_selection_scores(query, [r[0] for r in rows], torch.tensor(290), None,
                                                 [r[1] for r in rows])
        assert cpu_selection.int8_dot_calls() - before == int(fast)
        q_levels, q_scales = int8_keys.quantize_rows(query)
        q_wide = q_levels.double() * q_scales.double().unsqueeze(-1)
        wide = [levels.double() * scales.double().unsqueeze(-1) for levels, scales in rows]
        torch.testing.assert_close(got.double(), _reference(q_wide, wide, torch.tensor(290), None), atol=2e-6,
                                   rtol=1e-4)


def test_int8_keys_rank_as_the_float_keys_do_up_to_their_rounding():
    """At SmolLM2's shape over 2K random keys, the int8 rows' scores differ from the float32
    keys' by less than the rounding can move a softmax weight, and the top 256 positions agree
    (>= 95% overlap: a rounding of half a scale per entry reorders only near ties)."""
    from specontext_compile.runtime import int8_keys

    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 1, 9, 1, 64, generator=gen) * 64 ** -0.5 * 3
    keys = [torch.randn(1, 3, 2048, 64, generator=gen) for _ in range(3)]
    rows = [int8_keys.quantize_rows(k) for k in keys]
    length = torch.tensor(2048)
    exact = cpu_selection.cpu_selection_scores(query, keys, length, None)
    got = cpu_selection.cpu_selection_scores(query, [r[0] for r in rows], length, None, [r[1] for r in rows])
    assert 0 < (got - exact).abs().max() < 0.05 * exact.max()
    top = exact.topk(256, -1).indices
    kept = got.topk(256, -1).indices
    overlap = [len(set(a.tolist()) & set(c.tolist())) / 256 for a, c in zip(top.view(-1, 256), kept.view(-1, 256))]
    assert min(overlap) >= 0.95, overlap


def test_int8_keys_without_their_scales_are_clear_errors():
    """int8 stores need one float32 scale a row, and only int8 stores take scales: each case a
    ValueError naming the fix, before any read."""
    from specontext_compile.runtime import int8_keys

    query_state, stores, cached = _inputs(torch.float32)
    q = query_state[:3].float()
    rows = [int8_keys.quantize_rows(s) for s in stores]
    levels, scales = [r[0] for r in rows], [r[1] for r in rows]
    with pytest.raises(ValueError, match="need key_scales"):
        cpu_selection.cpu_selection_scores(q, levels, cached, None)
    with pytest.raises(ValueError, match="need key_scales"):
        cpu_selection.cpu_selection_scores(q, levels, cached, None, scales[:2])
    with pytest.raises(ValueError, match="need key_scales"):
        cpu_selection.cpu_selection_scores(q, levels, cached, None, [s.double() for s in scales])
    with pytest.raises(ValueError, match="pass key_scales=None"):
        cpu_selection.cpu_selection_scores(q, stores, cached, None, scales)
    got = torch.ops.specontext.cpu_selection_scores(q, levels, cached, None, scales)  # through the op's schema
    assert torch.isfinite(got).all()


def test_a_mask_that_hides_only_unwritten_slots_is_dropped():
    """Hugging Face's decode mask (every written position visible): the kernel runs its
    mask-free path (csrc/cpu_common.h, needed_mask; counted) with the scores of a call without a
    mask, bit for bit; a mask that hides one written position is kept (not counted) and the
    position scores 0, as float64 says."""
    gen = torch.Generator().manual_seed(3)
    layers, b, kv, group, capacity, dim = 3, 2, 3, 3, 700, 64
    query = torch.randn(layers, b, kv * group, 1, dim, generator=gen) * 0.3
    stores = [torch.randn(b, kv, capacity, dim, generator=gen) for _ in range(layers)]
    length = torch.tensor([650, 400])
    written = torch.arange(capacity) < length.view(b, 1)
    lib = cpu_selection._library()
    before = cpu_kernels.masks_dropped(lib, "selection_scores")
    plain = cpu_selection.cpu_selection_scores(query, stores, length, None)
    assert torch.equal(cpu_selection.cpu_selection_scores(query, stores, length, written), plain)
    assert cpu_kernels.masks_dropped(lib, "selection_scores") == before + 1
    hidden = written.clone()
    hidden[1, 5] = False
    got = cpu_selection.cpu_selection_scores(query, stores, length, hidden)
    assert cpu_kernels.masks_dropped(lib, "selection_scores") == before + 1
    assert got[1, :, 5].eq(0).all()
    torch.testing.assert_close(got.double(), _reference(query, stores, length, hidden), atol=2e-6, rtol=1e-4)
