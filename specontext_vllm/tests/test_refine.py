"""The per-layer refinement (:mod:`specontext_vllm.refine`) against a float64 reference of its
definition, for the C++ kernel and the torch path, in every packing the kernel reads
(synthetic caches packed by :data:`~specontext_vllm.layout.FORMS`, so the AMX forms are checked
on any CPU):

* the output equals float64 attention over the ``budget`` candidates of highest group-max
  probability, the first ``sinks`` candidates and the last ``recent`` positions kept whatever
  their rank;
* with no more candidates than the budget it is exact attention over all of them;
* the kernel's argument checks refuse what it does not read.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specontext_vllm import kernels
from specontext_vllm.layout import FORMS, BlockLayout
from specontext_vllm.refine import forced_counts, refine_attend
from specontext_vllm.selection import with_blocks

BS, KV, D = 32, 2, 64
FORM_PAIRS = [("transposed", "rows", torch.float32), ("transposed", "rows", torch.bfloat16),
              ("key-tiles16", "value-tiles16", torch.bfloat16)]


def _layout(key_form: str, value_form: str) -> BlockLayout:
    t, j = torch.arange(BS).view(-1, 1), torch.arange(D).view(1, -1)
    offsets = [FORMS[f](t, j, BS, D).expand(BS, D).contiguous() for f in (key_form, value_form)]
    return BlockLayout(BS, D, key_form, value_form, *offsets)


def _pack(keys: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """A vLLM-shaped cache ``[blocks, kv, BS, 2 * D]`` holding ``keys``/``values`` ``[blocks, kv,
    BS, D]`` in ``layout``'s packing."""
    blocks = keys.shape[0]
    areas = torch.zeros(blocks, KV, 2, BS * D, dtype=keys.dtype)
    areas[:, :, 0, layout.key_offsets.flatten()] = keys.flatten(2)
    areas[:, :, 1, layout.value_offsets.flatten()] = values.flatten(2)
    return areas.view(blocks, KV, BS, 2 * D)


def _candidates(keys, values, block_table, selection, r, h):
    """Row ``r``'s candidates for KV head ``h``: positions int64 ``[n]``, float64 keys and
    values ``[n, D]``."""
    n = int(selection.seq_lens[r, h])
    logical = selection.logical[r, h]
    positions = torch.tensor([int(logical[i // BS]) * BS + i % BS for i in range(n)])
    physical = block_table[r].long()[positions // BS]
    return positions, keys[physical, h, positions % BS].double(), values[physical, h, positions % BS].double()


def _reference(keys, values, block_table, selection, query, row_len, budget, sinks, recent, coverage=False):
    """float64 ``[rows, kv, groups, D]`` from the definition, unit by unit; with ``coverage``
    also ``[rows, kv]``: the smallest over the groups' heads of the candidates' softmax mass
    the kept tokens hold (the fidelity guard's estimate)."""
    rows, kv, groups, _ = query.shape
    out = torch.zeros(rows, kv, groups, D, dtype=torch.float64)
    held = torch.ones(rows, kv, dtype=torch.float64)
    for r in range(rows):
        for h in range(kv):
            positions, k, v = _candidates(keys, values, block_table, selection, r, h)
            n = positions.numel()
            logits = query[r, h].double() @ k.T  # [groups, n]
            rank = torch.softmax(logits, -1).amax(0)
            forced = (torch.arange(n) < sinks) | (positions >= int(row_len[r]) - recent)
            rank = torch.where(forced, float("inf"), rank)
            kept = rank.argsort(descending=True, stable=True)[: min(budget, n)]  # ties: the earliest
            out[r, h] = torch.softmax(logits[:, kept], -1) @ v[kept]
            held[r, h] = torch.softmax(logits, -1)[:, kept].sum(-1).min()
    return (out, held) if coverage else out


def _case(seed: int, dtype: torch.dtype, rows: int = 3, groups: int = 3):
    """Random keys, values, block tables and selections of ``rows`` decode rows: each row and KV
    head keeps a random set of its blocks, the first and the current one among them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 4 + 6 * rows
    keys = torch.randn(blocks, KV, BS, D, generator=gen).to(dtype)
    values = torch.randn(blocks, KV, BS, D, generator=gen).to(dtype)
    lengths = torch.randint(BS + 1, 6 * BS, (rows,), generator=gen)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:6] for _ in range(rows)]).to(torch.int32)
    logical = torch.full((rows, KV, 6), -1, dtype=torch.long)
    for r in range(rows):
        last = (int(lengths[r]) - 1) // BS
        for h in range(KV):
            middle = [b for b in range(1, last) if torch.rand(1, generator=gen) < 0.6]
            chosen = sorted({0, *middle, last})
            logical[r, h, : len(chosen)] = torch.tensor(chosen)
    selection = with_blocks(logical, table, lengths, BS, torch.tensor(0), 6)
    query = torch.randn(rows, KV, groups, D, generator=gen) * 0.3
    return keys, values, table, selection, query, lengths


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("key_form,value_form,dtype", FORM_PAIRS)
def test_the_refinement_equals_float64_attention_over_the_best_candidates(path, key_form, value_form, dtype,
                                                                          take_path):
    calls = take_path(path, "refine_available", "paged_refine_attention")
    _check_refinement(key_form=key_form, value_form=value_form, dtype=dtype)
    assert bool(calls) == (path == "kernel")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([16, 40, 100, 4096]),
       sink_tokens=st.integers(0, 6), recent_window=st.integers(1, 40))
def _check_refinement(seed, budget, sink_tokens, recent_window, key_form, value_form, dtype):
    keys, values, table, selection, query, lengths = _case(seed, dtype)
    layout = _layout(key_form, value_form)
    cache = _pack(keys, values, layout)
    sinks, recent = forced_counts(budget, sink_tokens, recent_window)
    got = refine_attend(layout, cache, table, selection, query.flatten(1, 2), 1.0, lengths, budget, sinks, recent)
    want = _reference(keys, values, table, selection, query, lengths, budget, sinks, recent)
    torch.testing.assert_close(got.double().view_as(want), want, rtol=0, atol=2e-5)


def test_with_no_more_candidates_than_the_budget_it_is_exact_attention_over_them():
    keys, values, table, selection, query, lengths = _case(7, torch.float32)
    layout = _layout("transposed", "rows")
    cache = _pack(keys, values, layout)
    got = refine_attend(layout, cache, table, selection, query.flatten(1, 2), 1.0, lengths, 6 * BS, 0, 1)
    rows = query.shape[0]
    for r in range(rows):
        for h in range(KV):
            _, k, v = _candidates(keys, values, table, selection, r, h)
            want = torch.softmax(query[r, h].double() @ k.T, -1) @ v
            torch.testing.assert_close(got.view(rows, KV, -1, D)[r, h].double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_ties_keep_the_earliest_candidates(path, take_path):
    """A query of zeros: every candidate ties; the kept ones are the forced and then the
    earliest, ``budget`` of them, and the output is their values' mean."""
    calls = take_path(path, "refine_available", "paged_refine_attention")
    keys, values, table, selection, query, lengths = _case(11, torch.float32)
    layout = _layout("transposed", "rows")
    got = refine_attend(layout, _pack(keys, values, layout), table, selection, torch.zeros_like(query).flatten(1, 2),
                        1.0, lengths, 24, 2, 5)
    want = _reference(keys, values, table, selection, torch.zeros_like(query), lengths, 24, 2, 5)
    torch.testing.assert_close(got.double().view_as(want), want, rtol=0, atol=2e-6)
    assert bool(calls) == (path == "kernel")


def test_a_budget_above_every_candidate_allocates_by_the_candidates():
    """A budget far above the context (how a user asks for exact attention) keeps every
    candidate and sizes the kernel's buffers by the candidates (it allocated by the budget:
    ``std::bad_alloc`` at 2**31)."""
    keys, values, table, selection, query, lengths = _case(5, torch.float32)
    layout = _layout("transposed", "rows")
    cache = _pack(keys, values, layout)
    small = refine_attend(layout, cache, table, selection, query.flatten(1, 2), 1.0, lengths, 6 * BS, 0, 1)
    huge = refine_attend(layout, cache, table, selection, query.flatten(1, 2), 1.0, lengths, 2**31, 0, 1)
    torch.testing.assert_close(huge, small, rtol=0, atol=0)


def test_a_block_size_above_the_kernels_takes_the_torch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "paged_refine_attention", lambda *a: calls.append(1))
    monkeypatch.setattr(kernels, "MAX_BLOCK", BS - 1)  # this case's blocks are "too large"
    _check_refinement(key_form="transposed", value_form="rows", dtype=torch.float32)
    assert not calls


def test_the_kernel_refuses_what_it_does_not_read():
    if not kernels.refine_available():
        pytest.skip("the plugin's refinement kernel does not build here")
    keys, values, table, selection, query, lengths = _case(3, torch.float32)
    cache = _pack(keys, values, _layout("transposed", "rows"))
    with pytest.raises(ValueError, match="no kernel"):  # AMX tiles are bfloat16 only
        kernels.paged_refine_attention(cache, selection.tables, selection.logical, selection.seq_lens, lengths, query,
                                       ("key-tiles16", "value-tiles16"), 16, 0, 1)
    outside = selection.tables.clone()
    outside[0, 0, 0] = cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        kernels.paged_refine_attention(cache, outside, selection.logical, selection.seq_lens, lengths, query,
                                       ("transposed", "rows"), 16, 0, 1)
    empty = selection.seq_lens.clone()
    empty[0, 0] = 0
    with pytest.raises(ValueError, match="candidate counts"):
        kernels.paged_refine_attention(cache, selection.tables, selection.logical, empty, lengths, query,
                                       ("transposed", "rows"), 16, 0, 1)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("key_form,value_form,dtype", FORM_PAIRS)
def test_the_guards_coverage_equals_float64(path, key_form, value_form, dtype, take_path):
    """Option ``min_coverage``'s estimate: per row and KV head, the smallest over the group's
    query heads of the candidates' softmax mass the kept tokens hold, within 1e-5 of float64;
    1 where every candidate is kept; the output unchanged by asking for it."""
    calls = take_path(path, "refine_available", "paged_refine_attention")
    _check_coverage(key_form=key_form, value_form=value_form, dtype=dtype)
    assert bool(calls) == (path == "kernel")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([16, 40, 4096]))
def _check_coverage(seed, budget, key_form, value_form, dtype):
    keys, values, table, selection, query, lengths = _case(seed, dtype)
    layout = _layout(key_form, value_form)
    cache = _pack(keys, values, layout)
    sinks, recent = forced_counts(budget, 2, 8)
    args = (layout, cache, table, selection, query.flatten(1, 2), 1.0, lengths, budget, sinks, recent)
    out, share = refine_attend(*args, coverage=True)
    want_out, want = _reference(keys, values, table, selection, query, lengths, budget, sinks, recent, coverage=True)
    torch.testing.assert_close(share.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(out, refine_attend(*args))
    if budget == 4096:
        assert torch.all(share == 1.0)
    else:
        assert float(share.min()) < 1.0  # something dropped: the test can see a low coverage

