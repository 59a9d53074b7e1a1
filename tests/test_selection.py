"""Selection invariants (property-based) and the speculative-select op."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from benchmarks.host_selection import select_tokens, selection_size

from specontext_compile.runtime import scorers
from specontext_compile.runtime.spec import AttentionVariant, StepSpec


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), q_len=st.integers(1, 4), budget=st.integers(1, 128),
       sink=st.integers(0, 8), window=st.integers(0, 40), seed=st.integers(0, 999))
def test_selection_invariants(length, q_len, budget, sink, window, seed):
    slots = selection_size(budget, capacity=length + 5)
    q_len = min(q_len, length, slots)  # the pass keeps steps longer than the budget dense
    scores = torch.rand(2, 3, length - q_len, generator=torch.Generator().manual_seed(seed))
    idx = select_tokens(scores, length, q_len, slots, sink, window)
    assert idx.shape == (2, 3, slots) and idx.dtype == torch.long
    for row in idx.reshape(-1, slots):
        valid = row[row >= 0]
        assert valid.numel() == min(slots, length)  # never empty, fills the budget
        assert valid.unique().numel() == valid.numel()  # no duplicates
        assert int(valid.max()) < length
        assert set(range(length - q_len, length)) <= set(valid.tolist())  # current tokens


def test_selection_smaller_than_step_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="cannot hold"):
        select_tokens(torch.zeros(1, 1, 10), length=12, q_len=2, slots=1, sink=0, window=0)


def test_selection_keeps_top_scores():
    scores = torch.zeros(1, 1, 100)
    scores[0, 0, [10, 50, 70]] = 1.0
    idx = select_tokens(scores, length=101, q_len=1, slots=8, sink=2, window=3)
    assert set(idx[0, 0].tolist()) == {0, 1, 98, 99, 100, 10, 50, 70}


def test_speculative_select_uses_group_max():
    # 2 KV heads x 2 query heads; query head 1 of KV head 0 points at key 5
    keys = torch.zeros(1, 2, 64, 4)
    keys[0, 0, 5] = torch.tensor([10.0, 0, 0, 0])
    keys[0, 1, 9] = torch.tensor([0, 10.0, 0, 0])
    q = torch.zeros(1, 4, 1, 4)
    q[0, 1, 0, 0] = 1.0
    q[0, 2, 0, 1] = 1.0
    # the query was recorded by the step that wrote the 40 cached tokens (stamp 40)
    idx = scorers.speculative_select(
        (q[None], torch.tensor([40])), [keys], torch.tensor(40), 1, StepSpec(3, 3, recent_window=2),
        AttentionVariant(1.0))
    assert 5 in idx[0, 0].tolist() and 9 in idx[0, 1].tolist()
    assert 40 in idx[0, 0].tolist()


@pytest.mark.parametrize("stamp", [0, 1, 39, 41])
def test_a_query_stamped_with_another_length_is_not_used(stamp):
    """A lagged query is used only by the step right after the one that recorded it (stamp
    == tokens cached now); any other stamp (never recorded, before a crop or a reset,
    another prompt) selects by recency: sinks + the most recent tokens."""
    keys = torch.zeros(1, 1, 64, 4)
    keys[0, 0, 5] = torch.tensor([10.0, 0, 0, 0])
    q = torch.zeros(1, 1, 2, 1, 4)
    q[0, 0, 0, 0, 0] = 1.0
    args = ([keys], torch.tensor(40), 1, StepSpec(6, 6, sink_tokens=1, recent_window=2), AttentionVariant(1.0))
    fresh = scorers.speculative_select((q, torch.tensor([40])), *args)
    stale = scorers.speculative_select((q, torch.tensor([stamp])), *args)
    assert 5 in fresh[0, 0].tolist()
    assert sorted(stale[0, 0].tolist()) == [0, 36, 37, 38, 39, 40]


def test_speculative_select_falls_back_to_recency_without_query():
    keys = torch.randn(1, 1, 64, 4)
    idx = scorers.speculative_select(
        (torch.zeros(1, 1, 2, 1, 4), torch.tensor([0])), [keys], torch.tensor(40), 1,
        StepSpec(6, 6, sink_tokens=1, recent_window=2), AttentionVariant(0.5))
    assert sorted(idx[0, 0].tolist()) == [0, 36, 37, 38, 39, 40]
