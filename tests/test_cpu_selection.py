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
