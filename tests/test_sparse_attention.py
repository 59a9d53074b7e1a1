"""The sparse attention op against a float64 dense reference restricted to the selection."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

import specontext_compile  # noqa: F401

# float32 inputs, softmax in float32: observed max error ~1e-6; bound stated with margin
ATOL, RTOL = 2e-5, 1e-4

GATHER = StepSpec(1, 1)  # the torch path, no dense shortcut: the op's plain gather


def dense_reference(query, key_cache, value_cache, indices, length, scale):
    """float64 softmax attention over the selected positions, written the obvious way."""
    b, hq, q_len, _ = query.shape
    hkv = key_cache.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hq, q_len, value_cache.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // g
            sel = [int(i) for i in indices[bi, kv] if i >= 0]
            for r in range(q_len):
                allowed = [p for p in sel if p <= length - q_len + r]
                if not allowed:
                    continue
                k = key_cache[bi, kv, allowed].double()
                v = value_cache[bi, kv, allowed].double()
                w = torch.softmax(k @ query[bi, h, r].double() * scale, dim=0)
                out[bi, h, r] = w @ v
    return out


@st.composite
def cases(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8, 16]))
    length = draw(st.integers(1, 40))
    capacity = length + draw(st.integers(0, 8))
    q_len = draw(st.integers(1, min(3, length)))
    budget = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**16))
    return b, hkv, g, d, length, capacity, q_len, budget, seed


def random_selection(gen, b, hkv, length, budget):
    """Unique unsorted positions < length, the newest always present, -1 padded."""
    slots = min(budget, length) if budget < length else budget
    idx = torch.full((b, hkv, slots), -1, dtype=torch.long)
    for bi in range(b):
        for h in range(hkv):
            k = min(slots, length)
            others = torch.randperm(length - 1, generator=gen)[: k - 1]
            row = torch.cat([torch.tensor([length - 1]), others])
            idx[bi, h, :k] = row[torch.randperm(k, generator=gen)]
    return idx


def random_inputs(gen, b, hkv, g, d, length, capacity, q_len):
    """query, key and value caches; the unwritten slots (>= length) poisoned with NaN."""
    query = torch.randn(b, hkv * g, q_len, d, generator=gen)
    key_cache = torch.randn(b, hkv, capacity, d, generator=gen)
    value_cache = torch.randn(b, hkv, capacity, d, generator=gen)
    key_cache[:, :, length:] = float("nan")  # unwritten slots must never be read
    value_cache[:, :, length:] = float("nan")
    return query, key_cache, value_cache


@settings(max_examples=60, deadline=None)
@given(cases())
def test_sparse_attention_matches_float64_reference(case):
    b, hkv, g, d, length, capacity, q_len, budget, seed = case
    gen = torch.Generator().manual_seed(seed)
    query, key_cache, value_cache = random_inputs(gen, b, hkv, g, d, length, capacity, q_len)
    indices = random_selection(gen, b, hkv, length, budget)
    scale = 1 / math.sqrt(d)
    out = torch.ops.specontext.sparse_attention(
        query, key_cache, value_cache, indices, torch.tensor(length), None, GATHER, AttentionVariant(scale))
    ref = dense_reference(query, key_cache, value_cache, indices, length, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_full_selection_equals_sdpa_with_mask():
    gen = torch.Generator().manual_seed(1)
    b, hkv, g, d, cap, length = 2, 2, 3, 16, 32, 21
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    k = torch.randn(b, hkv, cap, d, generator=gen)
    v = torch.randn(b, hkv, cap, d, generator=gen)
    mask = torch.zeros(b, 1, 1, cap, dtype=torch.bool)
    mask[..., :length] = True
    mask[1, ..., :3] = False  # left padding of the second request
    idx = torch.cat([torch.arange(length), torch.full((11,), -1)]).expand(b, hkv, -1)
    out = torch.ops.specontext.sparse_attention(q, k, v, idx.contiguous(), torch.tensor(length), mask, GATHER,
                                                AttentionVariant(d**-0.5))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1), attn_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_context_of_one_token_never_empty_or_nan():
    q = torch.randn(1, 3, 1, 8)
    k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    idx = torch.tensor([[[0, -1, -1]]])
    out = torch.ops.specontext.sparse_attention(q, k, v, idx, torch.tensor(1), None, GATHER, AttentionVariant(0.3))
    torch.testing.assert_close(out, v[:, :, :1].expand(1, 3, 1, 8))


def test_fold_mask_hides_exactly_the_masked_selected_positions():
    """The kernel route's mask: a position the bool mask hides becomes a ``-1`` slot (what the
    kernel skips), padding stays padding, every other slot is kept; no host read is needed.
    Any mask it cannot apply exactly is refused with the fix (a hand-built spec: the pass
    routes such sites to the gather path): float, one per head, several query rows, narrower
    than the store."""
    from specontext_compile.runtime.kernel_step import fold_mask

    idx = torch.tensor([[[0, 2, 5, -1], [1, 2, 3, 9]]])  # [1, 2 kv heads, 4]
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    mask[..., 2] = False
    assert torch.equal(fold_mask(idx, mask, 12), torch.tensor([[[0, -1, 5, -1], [1, -1, 3, 9]]]))
    assert torch.equal(fold_mask(idx.transpose(0, 1).contiguous().transpose(0, 1), mask, 12), fold_mask(idx, mask, 12))
    assert fold_mask(idx, None, 12) is idx
    for bad, rows in ((mask.float(), 1), (mask.expand(1, 2, 1, 12), 1), (mask.expand(1, 1, 2, 12), 2),
                      (mask[..., :8], 1)):
        with pytest.raises(ValueError, match="route='gather'"):
            fold_mask(idx, bad, 12, rows)


def test_an_additive_mask_is_read_as_its_bool_source_only_when_it_is_zero_or_hidden():
    """``site_nodes.boolean_source``: Hugging Face's eager mask ``where(visible, zeros(()),
    finfo.min)`` is the bool ``visible`` (the kernel route folds that); negative cases keep
    the float mask: a visible value other than 0, a hidden value that does not hide, a
    condition that is not bool."""
    from specontext_compile.passes.site_nodes import boolean_source
    from torch import fx

    graph = fx.Graph()
    visible, scores = graph.placeholder("visible"), graph.placeholder("scores")
    visible.meta["example_value"] = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    scores.meta["example_value"] = torch.ones(1, 1, 1, 8)
    zero = graph.call_function(torch.zeros, ((),), {"dtype": torch.float32})
    low = torch.finfo(torch.float32).min
    assert boolean_source(graph.call_function(torch.where, (visible, zero, low))) is visible
    assert boolean_source(graph.call_function(torch.where, (visible, 0.0, float("-inf")))) is visible
    assert boolean_source(graph.call_function(torch.where, (visible, 1.0, low))) is None
    assert boolean_source(graph.call_function(torch.where, (visible, zero, -1.0))) is None
    assert boolean_source(graph.call_function(torch.where, (scores, zero, low))) is None
    assert boolean_source(graph.call_function(torch.add, (visible, zero))) is None


def full_selection(b, hkv, length, capacity):
    """Every written position (shuffled order is not needed: the op takes any order) then
    ``-1`` padding, one slot per store position: what a selection node returns when the
    budget covers the store."""
    row = torch.cat([torch.arange(length), torch.full((capacity - length,), -1)])
    return row.expand(b, hkv, capacity).contiguous()


@settings(max_examples=40, deadline=None)
@given(cases())
def test_selection_covering_the_store_takes_the_dense_path_and_matches(case):
    """On the dense route (the pass decides it for ``dense_shortcut`` and a selection with a slot
    per store position) the op runs dense attention over the store; unwritten slots hold zeros,
    as the cache keeps them (allocation and ``reset``), and are masked by the causal limit."""
    from torch._dynamo.utils import counters

    b, hkv, g, d, length, capacity, q_len, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    query, key_cache, value_cache = random_inputs(gen, b, hkv, g, d, length, capacity, q_len)
    key_cache[:, :, length:] = 0.0
    value_cache[:, :, length:] = 0.0
    indices = full_selection(b, hkv, length, capacity)
    before = counters["specontext"]["dense_prefix_calls"], counters["specontext"]["gather_attention_calls"]
    out = torch.ops.specontext.sparse_attention(
        query, key_cache, value_cache, indices, torch.tensor(length), None,
        StepSpec(1, 1, dense_shortcut=True, route="dense"),
        AttentionVariant(d**-0.5))
    after = counters["specontext"]["dense_prefix_calls"], counters["specontext"]["gather_attention_calls"]
    assert after == (before[0] + 1, before[1])
    ref = dense_reference(query, key_cache, value_cache, indices, length, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_selection_covering_the_store_without_shortcut_gathers_and_matches(case):
    """The same selection without the shortcut (the op's default) runs the gather path and
    never reads an unwritten slot (poisoned with NaN)."""
    from torch._dynamo.utils import counters

    b, hkv, g, d, length, capacity, q_len, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    query, key_cache, value_cache = random_inputs(gen, b, hkv, g, d, length, capacity, q_len)
    indices = full_selection(b, hkv, length, capacity)
    before = counters["specontext"]["dense_prefix_calls"], counters["specontext"]["gather_attention_calls"]
    out = torch.ops.specontext.sparse_attention(
        query, key_cache, value_cache, indices, torch.tensor(length), None, GATHER, AttentionVariant(d**-0.5))
    after = counters["specontext"]["dense_prefix_calls"], counters["specontext"]["gather_attention_calls"]
    assert after == (before[0], before[1] + 1)
    ref = dense_reference(query, key_cache, value_cache, indices, length, d**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_dense_store_body_traced_for_inductor_reads_the_store_in_place_and_matches(case):
    """The dense shortcut's body as the backend traces it for inductor on CPU (a few query rows
    per KV head): the fused products over every slot, no SDPA call (whose CPU flash kernel
    read the store far below the copy rate at one query row), equal to the float64 reference
    and to the SDPA body traced outside it."""
    from specontext_compile.runtime.aten_step import _dense_store_attention
    from torch.fx.experimental.proxy_tensor import make_fx

    b, hkv, g, d, length, capacity, q_len, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    query, key_cache, value_cache = random_inputs(gen, b, hkv, g, d, length, capacity, q_len)
    key_cache[:, :, length:] = 0.0  # unwritten slots hold zeros, as the cache keeps them
    value_cache[:, :, length:] = 0.0
    def body(q, k, v, n):  # as the lowering leaves it for inductor
        return _dense_store_attention(q, k, v, n, None, AttentionVariant(d**-0.5, fused_products=True))

    def eager_body(q, k, v, n):
        return _dense_store_attention(q, k, v, n, None, AttentionVariant(d**-0.5))

    inputs = (query, key_cache, value_cache, torch.tensor(length))
    fused = make_fx(body)(*inputs)
    sdpa = make_fx(eager_body)(*inputs)

    def calls(gm):
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    assert not any("scaled_dot_product" in t for t in calls(fused)), calls(fused)
    assert any("scaled_dot_product" in t for t in calls(sdpa))
    ref = dense_reference(query, key_cache, value_cache, full_selection(b, hkv, length, capacity), length, d**-0.5)
    torch.testing.assert_close(fused(*inputs).double(), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused(*inputs), sdpa(*inputs), atol=ATOL, rtol=RTOL)
