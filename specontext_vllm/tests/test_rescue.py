"""The page rescue's parts against plain float64 references (:mod:`specontext_vllm.rescue`).

* Bounds follow the blocks: every block's low/high equal the elementwise min/max of the keys
  written there since its first slot was last written (a block rewritten from slot 0 forgets
  its old tokens), padding slots skipped.
* The Quest bound of a block is at least every logit of the block's tokens (group-max over the
  KV head's query heads), and equals a float64 computation of its definition.
* The rescue adds the top blocks by that bound among the row's written blocks that the shared
  selection did not keep, ``-1`` where fewer remain.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specontext_vllm.rescue import PageBounds, quest_bounds, rescue_blocks

BS, KV, D = 4, 2, 8


def _bounds(blocks=6):
    return PageBounds.for_cache(torch.zeros(blocks, KV, BS, 2 * D), D)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_bounds_are_the_min_and_max_of_each_blocks_keys_since_its_first_slot(seed):
    gen = torch.Generator().manual_seed(seed)
    bounds, blocks = _bounds(), 6
    held: dict[int, list[torch.Tensor]] = {}
    for _ in range(4):  # a few steps of writes, some restarting blocks at slot 0
        n = int(torch.randint(1, 9, (1,), generator=gen))
        slots = torch.randperm(blocks * BS, generator=gen)[:n]
        slots[torch.rand(n, generator=gen) < 0.2] = -1  # vLLM's padding
        keys = torch.randn(n, KV, D, generator=gen)
        bounds.write(keys, slots)
        for slot, key in sorted(zip(slots.tolist(), keys), key=lambda x: x[0]):
            if slot < 0:
                continue
            if slot % BS == 0:
                held[slot // BS] = []
            held.setdefault(slot // BS, []).append(key.double())
    for block, keys in held.items():
        if keys:
            stacked = torch.stack(keys)
            torch.testing.assert_close(bounds.low[block].double(), stacked.amin(0), rtol=0, atol=0)
            torch.testing.assert_close(bounds.high[block].double(), stacked.amax(0), rtol=0, atol=0)


def test_a_block_restarted_at_slot_zero_forgets_its_old_keys():
    bounds = _bounds()
    bounds.write(torch.full((2, KV, D), 5.0), torch.tensor([8, 9]))
    bounds.write(torch.full((1, KV, D), -1.0), torch.tensor([8]))  # block 2 reused from its first slot
    assert torch.equal(bounds.high[2], torch.full((KV, D), -1.0))
    assert torch.equal(bounds.low[2], torch.full((KV, D), -1.0))


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_the_quest_bound_holds_every_logit_of_its_block_and_equals_float64(path, take_path):
    """Both paths: the C++ kernel (``kernels.paged_quest_bounds``) and torch (where it does not
    build)."""
    calls = take_path(path, "available", "paged_quest_bounds")
    _check_quest_bounds()
    assert bool(calls) == (path == "kernel")


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3))
def _check_quest_bounds(seed, group):
    gen = torch.Generator().manual_seed(seed)
    rows, blocks = 2, 5
    bounds = _bounds(rows * blocks)
    table = torch.randperm(rows * blocks, generator=gen).view(rows, blocks).int()  # each row its own blocks
    keys = torch.randn(rows, blocks * BS, KV, D, generator=gen)
    for r in range(rows):
        slots = (table[r].long().repeat_interleave(BS) * BS + torch.arange(BS).repeat(blocks))
        bounds.write(keys[r], slots)
    query = torch.randn(rows, KV * group, D, generator=gen)
    got = quest_bounds(bounds, table, blocks, query)  # [rows, kv, blocks]
    q = query.double().view(rows, KV, group, D)
    k = keys.double().view(rows, blocks, BS, KV, D)
    low, high = k.amin(2), k.amax(2)  # [rows, blocks, kv, d]
    want = torch.maximum(q.unsqueeze(1) * low.unsqueeze(3), q.unsqueeze(1) * high.unsqueeze(3)).sum(-1).amax(-1)
    torch.testing.assert_close(got.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    logits = torch.einsum("rkgd,rbtkd->rkbtg", q, k).amax(-1).amax(-1)  # [rows, kv, blocks]
    assert bool((got.double() >= logits - 1e-5).all())


def test_the_rescue_takes_the_top_bounds_outside_the_selection():
    rows, blocks = 1, 6
    bounds = _bounds(8)
    table = torch.arange(blocks).view(1, blocks).int()
    keys = torch.zeros(blocks * BS, KV, D)
    for b, level in enumerate([9.0, 1.0, 7.0, 3.0, 8.0, 2.0]):  # block b's keys all equal `level`
        keys[b * BS:(b + 1) * BS] = level
    bounds.write(keys, torch.arange(blocks * BS))
    query = torch.ones(rows, KV, D)
    lens = torch.tensor([blocks * BS - 1])  # the last block partly written
    selected = torch.tensor([[[0, 5, -1]] * KV])  # the shared selection kept blocks 0 and 5
    got = rescue_blocks(bounds, table, lens, query, selected, 2, blocks)
    assert got.tolist() == [[[4, 2]] * KV]  # 8.0 and 7.0; block 0 (9.0) was already kept
    got = rescue_blocks(bounds, table, lens, query, selected, 10, blocks)  # more than remain
    assert sorted(got[0, 0].tolist()) == [-1, -1, 1, 2, 3, 4]
