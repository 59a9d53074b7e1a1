"""The decode step's query-key products as fused reductions where the graph is for inductor
(runtime.sparse_attention.row_products with the variant's ``fused_products``, which the lowering
sets): which path is taken, and that both give the matmul's values."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from specontext_compile.runtime import aten_step, cpu_refine, cpu_selection, page_bounds
from specontext_compile.runtime.sparse_attention import (
    FUSED_PRODUCT_ROWS,
    fused_products,
    product_chunks,
    row_products,
)
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from torch.fx.experimental.proxy_tensor import make_fx

_MATMULS = {torch.ops.aten.bmm.default, torch.ops.aten.mm.default}


@pytest.fixture(autouse=True)
def _torch_bodies(monkeypatch):
    """These tests read the torch bodies' traces: our CPU kernels of a refined site and of the
    selection (tests/test_cpu_refine.py, tests/test_cpu_selection.py) stay out of them."""
    monkeypatch.setattr(cpu_refine, "applies", lambda *a, **k: False)
    monkeypatch.setattr(cpu_selection, "applies", lambda *a, **k: False)


def _matmul_calls(fn, *args) -> int:
    """aten matmul nodes (bmm / mm) in ``fn`` traced to aten by make_fx (as AOTAutograd traces
    the lowered step for inductor)."""
    graph = make_fx(fn)(*args).graph
    return sum(node.target in _MATMULS for node in graph.nodes)


def _fused(rows, keys):
    return row_products(rows, keys, True)


def _unfused(rows, keys):
    return row_products(rows, keys)


def _reference(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.matmul(rows.double(), keys.double().transpose(-1, -2))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), r=st.integers(1, FUSED_PRODUCT_ROWS),
       n=st.one_of(st.integers(1, 40), st.sampled_from([64, 96, 512])),  # the latter in chunks (product_chunks)
       d=st.sampled_from([1, 8, 64, 72]), batch=st.sampled_from([(), (2,), (2, 3)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_traced_products_are_a_reduction_with_the_matmuls_values(seed, r, n, d, batch, dtype):
    """Fused (as the lowered step's variants say for inductor), a traced decode-sized product
    has no matmul node, and the traced graph's value equals float64's
    within float32 rounding (2e-6 of the terms' magnitude)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*batch, r, d, generator=g).to(dtype)
    keys = torch.randn(*batch, n, d, generator=g).to(dtype)
    assert fused_products(rows, keys, True)
    traced = make_fx(_fused)(rows, keys)
    assert not any(node.target in _MATMULS for node in traced.graph.nodes)
    got = traced(rows, keys)
    assert got.dtype == torch.float32
    magnitude = torch.matmul(rows.double().abs(), keys.double().abs().transpose(-1, -2))
    assert ((got.double() - _reference(rows, keys)).abs() <= 2e-6 * magnitude + 1e-12).all()


def test_products_stay_matmuls_unless_the_variant_says_fused():
    """Without ``fused`` (eager code: the op chain, ``inner="eager"``, where a fused product
    would be materialised as [..., r, n, d]) the product is a matmul, traced or not; inside
    an eager torch.cond's branches too (dynamo traces them: no flag of the trace changes it)."""
    rows, keys = torch.randn(2, 3, 8), torch.randn(2, 20, 8)
    assert not fused_products(rows, keys, False) and fused_products(rows, keys, True)
    assert make_fx(_unfused)(rows, keys).graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default)
    got = torch.cond(torch.tensor(True), _unfused, _unfused, (rows, keys))
    torch.testing.assert_close(got, torch.matmul(rows, keys.transpose(-1, -2)), atol=1e-6, rtol=1e-6)


def test_prefill_sized_rows_keep_the_matmul():
    """More query rows than FUSED_PRODUCT_ROWS (a prefill chunk) keep the matmul when traced."""
    rows, keys = torch.randn(2, FUSED_PRODUCT_ROWS + 1, 8), torch.randn(2, 20, 8)
    assert _matmul_calls(_fused, rows, keys) == 1
    assert _matmul_calls(_fused, rows[:, :FUSED_PRODUCT_ROWS], keys) == 0


def _refined_site(seed: int = 0, context: int = 200, capacity: int = 256, budget: int = 32, page: int = 16):
    """A refined decode site with the page rescue at SmolLM2's head shape (9 query / 3 KV
    heads, head_dim 64), small context: inputs, spec, variant."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 3, capacity, 64, generator=g)
    values = torch.randn(1, 3, capacity, 64, generator=g)
    query = torch.randn(1, 9, 1, 64, generator=g)
    length = torch.tensor(context)
    lo = torch.zeros(1, 3, page_bounds.page_count(capacity, page), 64)
    hi = torch.zeros_like(lo)
    page_bounds.update_page_bounds(keys, lo, hi, length, context, page)
    scores = torch.rand(1, 3, capacity, generator=g)
    candidates = aten_step.select_positions(scores, length - 1, 1, budget, 4, 8)
    spec = StepSpec(budget, budget, sink_tokens=4, recent_window=8, rescue_tokens=4 * page, page_tokens=page)
    return (query, keys, values, length, lo, hi, candidates), spec, AttentionVariant(64 ** -0.5)


def _for_inductor(variant: AttentionVariant) -> AttentionVariant:
    """The variant as the lowering leaves it in a graph for inductor."""
    return dataclasses.replace(variant, fused_products=True)


def test_the_lowered_refined_site_multiplies_only_the_values():
    """The body a refined site with the page rescue lowers to (aten_step.refine_and_attend)
    traced as inductor traces it: its one matmul is the attention's product with the kept
    values; the page bounds' and the candidates' products with the query are reductions."""
    inputs, spec, variant = _refined_site()
    variant = _for_inductor(variant)

    def site(query, keys, values, length, lo, hi, candidates):
        return aten_step.refine_and_attend(query, (keys, values), candidates, length, None, spec, variant,
                                           (lo, hi, None))

    assert _matmul_calls(site, *inputs) == 1


def test_the_compiled_refined_site_equals_its_eager_body():
    """Compiled by inductor (fused products) the refined site gives its eager body's output
    (matmuls) within float32 rounding: 1e-5."""
    from torch._inductor.compile_fx import compile_fx

    inputs, spec, variant = _refined_site(seed=3)

    def site(query, keys, values, length, lo, hi, candidates, variant=variant):
        return aten_step.refine_and_attend(query, (keys, values), candidates, length, None, spec, variant,
                                           (lo, hi, None))

    def fused(*args):
        return site(*args, variant=_for_inductor(variant))

    compiled = compile_fx(make_fx(fused)(*inputs), list(inputs))
    got = compiled(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, site(*inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_the_matmul():
    rows, keys = torch.randn(2, 3, 8, device="cuda"), torch.randn(2, 20, 8, device="cuda")
    assert _matmul_calls(_fused, rows, keys) == 1


@pytest.mark.parametrize("inner", ["auto", "eager"])
def test_the_backend_fuses_the_products_only_when_inductor_compiles(inner, monkeypatch):
    """Through the backend on a tiny Llama (budget 8, page rescue on, 3 decode steps): the
    decode products are traced fused when inductor compiles the step (``inner="auto"``) and
    are matmuls when the lowered graph runs eagerly (``inner="eager"``); either way the step's
    logits equal the other's within 1e-5 and the sparse path ran."""
    from _tiny import compiled_steps, tiny_llama
    from specontext_compile.runtime import sparse_attention

    calls = []
    real = sparse_attention.fused_products

    def spy(rows, keys, fused):
        calls.append(real(rows, keys, fused))
        return calls[-1]

    monkeypatch.setattr(sparse_attention, "fused_products", spy)
    model = tiny_llama(layers=2)
    ids = torch.randint(1, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    # a cache hit would skip the trace this test observes
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        logits, cache = compiled_steps(model, ids, 3, budget=8, inner=inner, page_rescue=16)
    assert cache.path_counts()["gather_sites"] > 0
    assert calls and (any(calls) if inner == "auto" else not any(calls))
    monkeypatch.setattr(sparse_attention, "fused_products", real)
    other, _ = compiled_steps(model, ids, 3, budget=8, inner="eager" if inner == "auto" else "auto", page_rescue=16)
    torch.testing.assert_close(logits, other, atol=1e-5, rtol=1e-5)


def test_fused_products_read_their_rows_from_a_buffer_of_their_own():
    """Traced for inductor, a fused product's rows pass through inductor's force_stride_order
    (written once to a buffer: a rotary query is not recomputed for every key); its values
    stay the matmul's. Unfused no such node: the eager product is a matmul."""
    from torch._inductor import inductor_prims

    def rotary_logits(query, cos, sin, keys, fused=False):
        half = query.shape[-1] // 2
        rotated = query * cos + torch.cat([-query[..., half:], query[..., :half]], -1) * sin
        return row_products(rotated, keys, fused)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g),
            torch.randn(2, 50, 8, generator=g))
    force = inductor_prims.force_stride_order
    def fused(*args):
        return rotary_logits(*args, fused=True)

    def unfused(query, cos, sin, keys):
        return rotary_logits(query, cos, sin, keys)

    traced = make_fx(fused)(*args)
    assert traced.graph.find_nodes(op="call_function", target=force)
    assert not make_fx(unfused)(*args).graph.find_nodes(op="call_function", target=force)
    torch.testing.assert_close(traced(*args), rotary_logits(*args), atol=1e-5, rtol=1e-5)


def test_the_refined_site_writes_its_masked_logits_once():
    """Traced for inductor, the refined site's masked logits (the product, the causal limit and
    the mask's gather: ``masked_fill``) go through force_stride_order before the softmax and the
    ranking read them (sparse_attention.logits_once), so inductor computes each logit once
    instead of once per reading pass; an eager trace has no such node; both traces give the
    eager body's output."""
    from torch._inductor import inductor_prims

    inputs, spec, variant = _refined_site()
    capacity = inputs[1].shape[2]
    mask = torch.ones(1, 1, 1, capacity, dtype=torch.bool)

    def site(query, keys, values, length, lo, hi, candidates, attn_mask, variant=variant):
        return aten_step.refine_and_attend(query, (keys, values), candidates, length, attn_mask, spec, variant,
                                           (lo, hi, None))

    def realized_logits(graph):
        force = graph.find_nodes(op="call_function", target=inductor_prims.force_stride_order)
        return [node for node in force if node.args[0].target == torch.ops.aten.masked_fill.Scalar]

    def fused(*args):
        return site(*args, variant=_for_inductor(variant))

    def unfused(*args):
        return site(*args)

    traced = make_fx(fused)(*inputs, mask)
    assert len(realized_logits(traced.graph)) == 1
    assert not realized_logits(make_fx(unfused)(*inputs, mask).graph)
    torch.testing.assert_close(traced(*inputs, mask), site(*inputs, mask), atol=1e-5, rtol=1e-5)


def test_products_of_few_rows_split_their_keys_into_chunks_for_the_threads():
    """SmolLM2's decode shape (3 KV heads, 3 query rows each, 512 candidates): the fused product
    runs in 16 chunks of 32 keys (48 parallel items, not 3) and still equals float64's (bfloat16
    keys too); not for float16 keys (not measured), broadcast rows, many leading items, or keys
    that do not divide."""
    gen = torch.Generator().manual_seed(0)
    rows, keys = torch.randn(1, 3, 3, 64, generator=gen), torch.randn(1, 3, 512, 64, generator=gen)
    assert product_chunks(rows, keys) == 16
    gm = make_fx(_fused)(rows, keys)
    assert any(node.target == torch.ops.aten.permute.default for node in gm.graph.nodes)  # the chunks read back
    torch.testing.assert_close(gm(rows, keys).double(), _reference(rows, keys), atol=1e-5, rtol=1e-5)
    assert product_chunks(rows.bfloat16(), keys.bfloat16()) == 16
    assert product_chunks(rows.half(), keys.half()) == 1
    assert product_chunks(rows[:, :1], keys) == 1  # rows broadcast over the KV heads
    assert product_chunks(torch.randn(8, 3, 3, 64), torch.randn(8, 3, 512, 64)) == 1  # 24 items already
    assert product_chunks(rows, keys[:, :, :509]) == 1
