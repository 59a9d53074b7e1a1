"""The split store attention (runtime/split_store.py): exact against float64 softmax attention
over the store with every mask kind and a tail, in eager and compiled by inductor, and taken
by the dense shortcut's traced body when (and only when) the store is worth splitting."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime import aten_step
from specontext_compile.runtime.spec import AttentionVariant
from specontext_compile.runtime.split_store import UNROLL, split_chunks, split_store_attention
from test_sparse_attention import cases as attention_cases

import specontext_compile  # noqa: F401

# float32 inputs, softmax and sums in float32 (summation order differs from the reference):
# observed max error ~1e-6; bound stated with margin
ATOL, RTOL = 2e-5, 1e-4


def reference(query, key_cache, value_cache, length, attn_mask, scale):
    """float64 softmax attention over every slot ``p <= length - q_len + r`` (and the mask),
    written the obvious way; a row that may see nothing is zeros."""
    b, hq, q_len, _ = query.shape
    hkv, capacity = key_cache.shape[1], key_cache.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hq, q_len, value_cache.shape[-1], dtype=torch.float64)
    for bi in range(b):
        n = int(length[bi]) if length.dim() else int(length)
        for h in range(hq):
            for r in range(q_len):
                logits = key_cache[bi, h // g].double() @ query[bi, h, r].double() * scale
                allowed = torch.arange(capacity) <= n - q_len + r
                if attn_mask is not None:
                    m = attn_mask[min(bi, attn_mask.shape[0] - 1), min(h, attn_mask.shape[1] - 1), r, :capacity]
                    if m.dtype == torch.bool:
                        allowed &= m
                    else:
                        logits = logits + m.double()
                if not allowed.any():
                    continue
                w = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=0)
                out[bi, h, r] = w @ value_cache[bi, h // g].double()
    return out


@st.composite
def cases(draw):
    b, hkv, g, d, *_, seed = draw(attention_cases())  # the sparse attention's head shapes
    chunks = draw(st.sampled_from([2, 4, 8]))
    capacity = chunks * UNROLL * draw(st.integers(1, 4)) + draw(st.sampled_from([0, 0, 1, 3, 7]))  # a tail, or none
    length = draw(st.integers(1, capacity))
    q_len = draw(st.integers(1, min(3, length)))
    mask = draw(st.sampled_from(["none", "bool", "additive", "bool-heads"]))
    per_row = draw(st.booleans())
    return b, hkv, g, d, chunks, capacity, length, q_len, mask, per_row, seed


def make_inputs(case):
    b, hkv, g, d, chunks, capacity, length, q_len, mask, per_row, seed = case
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hkv * g, q_len, d, generator=gen)
    key_cache = torch.randn(b, hkv, capacity, d, generator=gen)
    value_cache = torch.randn(b, hkv, capacity, d, generator=gen)
    key_cache[:, :, length:] = 1e4  # unwritten slots: huge keys and values must stay hidden
    value_cache[:, :, length:] = 1e4
    n = torch.tensor([length] + [max(q_len, length - 1)] * (b - 1)) if per_row else torch.tensor(length)
    heads = hkv * g if mask == "bool-heads" else 1
    visible = torch.rand(b, heads, q_len, capacity + 3, generator=gen) > 0.3  # padding, wider than the store
    attn_mask = {"none": None, "bool": visible, "bool-heads": visible,
                 "additive": torch.where(visible, 0.0, -30.0) + torch.rand(visible.shape, generator=gen)}[mask]
    return query, key_cache, value_cache, n, attn_mask, chunks


@settings(max_examples=60, deadline=None)
@given(cases())
def test_split_store_attention_matches_float64_reference(case):
    query, key_cache, value_cache, length, attn_mask, chunks = make_inputs(case)
    scale = query.shape[-1] ** -0.5
    out = split_store_attention(query, key_cache, value_cache, length, attn_mask, AttentionVariant(scale), chunks)
    assert out.dtype == query.dtype and not out.isnan().any()
    ref = reference(query, key_cache, value_cache, length, attn_mask, scale)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_split_store_attention_compiled_by_inductor_matches_and_hides_masked_rows():
    """Compiled by inductor (as the backend runs it; SmolLM2's head shape, a tail of 5 slots):
    equal to the float64 reference, and a head whose mask hides every slot gives zeros."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, 1, 64, generator=gen)
    key_cache, value_cache = (torch.randn(1, 3, 517, 64, generator=gen) for _ in range(2))
    attn_mask = torch.ones(1, 9, 1, 517, dtype=torch.bool)
    attn_mask[0, 4] = False
    length = torch.tensor(300)
    chunks = split_chunks(3, 517)
    assert chunks == 16
    fn = torch.compile(lambda q, k, v, n, m: split_store_attention(q, k, v, n, m, AttentionVariant(0.125), chunks),
                       backend="inductor", fullgraph=True)
    out = fn(query, key_cache, value_cache, length, attn_mask)
    ref = reference(query, key_cache, value_cache, length, attn_mask, 0.125)
    assert (out[0, 4] == 0).all()
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)


def test_split_chunks_wants_float32_few_rows_and_a_large_enough_store():
    assert split_chunks(3, 8205) == 16  # SmolLM2 at batch 1: 48 (row, chunk) pairs, a tail of 13
    assert split_chunks(6, 8256) == 8
    assert split_chunks(24, 8192) == 1  # enough rows for the threads already
    assert split_chunks(3, 100) == 2
    assert split_chunks(3, 40) == 1  # too small to be worth it
    assert split_chunks(3, 8205, torch.bfloat16) == 1  # measured slower in bfloat16
    for chunks, capacity in ((2, 7), (1, 64)):
        try:
            split_store_attention(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, capacity, 4),
                                  torch.zeros(1, 1, capacity, 4), torch.tensor(capacity), None, AttentionVariant(0.5),
                                  chunks)
        except ValueError as err:
            assert "split_chunks" in str(err)
        else:
            raise AssertionError("a store that does not split must raise")


def _traced(capacity, monkeypatch, dtype=torch.float32):
    """The dense shortcut's body traced for inductor; the chunks of every split it took (a spy
    on the module's name) and the graph's call targets."""
    from torch.fx.experimental.proxy_tensor import make_fx

    taken = []
    real = aten_step.split_store_attention

    def spy(*args):
        taken.append(args[-1])
        return real(*args)

    monkeypatch.setattr(aten_step, "split_store_attention", spy)
    # the split's own routing: our CPU kernel runs only where the pass chose it (``kernel``,
    # False here; tests/test_cpu_kernels.py routes to it)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, 6, 1, 16, generator=gen).to(dtype)
    key_cache, value_cache = (torch.randn(1, 2, capacity, 16, generator=gen).to(dtype) for _ in range(2))
    variant = AttentionVariant(0.25, fused_products=True)  # as the lowering leaves it for inductor
    length = torch.tensor(capacity - 3)
    gm = make_fx(lambda q, k, v, n: aten_step._dense_store_attention(q, k, v, n, None, variant))(
        query, key_cache, value_cache, length)
    ref = reference(query, key_cache, value_cache, length, None, 0.25)
    tol = ATOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gm(query, key_cache, value_cache, length).double(), ref, atol=tol, rtol=tol)
    return taken, {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_dense_shortcut_traced_body_takes_the_split_when_the_store_is_worth_splitting(monkeypatch):
    taken, calls = _traced(257, monkeypatch)  # 8 chunks of 32 slots and a tail of 1
    assert taken == [8] and not any("scaled_dot_product" in c for c in calls)
    for capacity, dtype in ((40, torch.float32), (257, torch.bfloat16)):  # too small; bfloat16
        taken, calls = _traced(capacity, monkeypatch, dtype)
        assert taken == [] and not any("scaled_dot_product" in c for c in calls)
