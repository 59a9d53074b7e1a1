"""Elastic loading's fixed-size device program (runtime/elastic.py, SpeContext section 5).

The slot plan against a plain Python statement of the rule (hypothesis), its run on the meta
device (no host read anywhere), and the Triton row copy (under the interpreter on CPU)
against the indexed copy, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specontext_compile.runtime.elastic import copy_changed_rows, copy_rows_reference, plan_slots


def _rule(pos_of_slot: list[int], selection: list[int], limit: int) -> list[int]:
    """The rule in plain Python: slots holding a selected token keep it; the selected
    positions below ``limit`` the buffer lacks, in selection order, fill the other slots in
    slot order."""
    held = set(pos_of_slot)
    missing = [p for p in selection if 0 <= p < limit and p not in held]
    free = [s for s, p in enumerate(pos_of_slot) if not (p >= 0 and p in set(selection))]
    new = list(pos_of_slot)
    for slot, position in zip(free, missing):
        new[slot] = position
    return new


@st.composite
def _buffers(draw):
    capacity = draw(st.integers(1, 40))
    rows, slots = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    k = draw(st.integers(1, slots))
    table, selection = [], []
    for _ in range(rows):
        held = draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=min(slots, capacity)))
        table.append(held + [-1] * (slots - len(held)))
        chosen = draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=min(k, capacity)))
        selection.append(chosen + [-1] * (k - len(chosen)))
    perm = draw(st.permutations(range(slots)))
    table = [[row[i] for i in perm] for row in table]
    return capacity, table, selection, draw(st.integers(0, capacity))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_buffers())
def test_the_slot_plan_follows_the_rule(case):
    capacity, table, selection, limit = case
    pos_of_slot, indices = torch.tensor(table), torch.tensor(selection)
    new_pos, changed, overflow = plan_slots(pos_of_slot, indices, torch.tensor(limit), capacity)
    want = [_rule(t, s, limit) for t, s in zip(table, selection)]
    assert new_pos.tolist() == want
    assert changed.tolist() == [[a != b for a, b in zip(old, new)] for old, new in zip(table, want)]
    assert not bool(overflow)  # k <= slots always has room
    # every selected position below the limit is now held
    for row, sel in zip(want, selection):
        assert {p for p in sel if 0 <= p < limit} <= set(row)


def test_an_overflowing_selection_is_reported_not_placed():
    """More missing positions than free slots (k > slots): flagged, the free slots filled."""
    new_pos, changed, overflow = plan_slots(torch.tensor([[5, -1]]), torch.tensor([[1, 2, 3]]), 10, 10)
    assert bool(overflow) and new_pos.tolist() == [[1, 2]] and changed.all()


def test_the_plan_reads_nothing_on_the_host():
    """On the meta device every host read (``bool``, ``item``, ``nonzero``) raises: the plan
    is a fixed-size device program, as a captured CUDA step needs."""
    pos_of_slot = torch.full((6, 64), -1, dtype=torch.long, device="meta")
    indices = torch.zeros((6, 48), dtype=torch.long, device="meta")
    for limit in (torch.zeros((), dtype=torch.long, device="meta"), 100):  # a device tensor, a Python int
        new_pos, changed, overflow = plan_slots(pos_of_slot, indices, limit, 4096)
        assert new_pos.shape == (6, 64) and changed.shape == (6, 64) and overflow.shape == ()


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_row_copy_equals_the_indexed_copy(dtype):
    """The kernel copies exactly the changed slots' rows, from a store whose (request, KV
    head) rows lie apart (a view of a larger ``[batch, kv, capacity, head_dim]``), and
    leaves the other slots untouched."""
    gen = torch.Generator().manual_seed(0)
    rows, slots, capacity, dim = 4, 21, 70, 40
    store = torch.randn(rows * 2, capacity, dim, generator=gen).to(dtype)[::2]  # row stride 2 * capacity * dim
    buffer = torch.randn(rows, slots, dim, generator=gen).to(dtype)
    new_pos = torch.randint(0, capacity, (rows, slots), generator=gen)
    changed = torch.rand(rows, slots, generator=gen) < 0.4
    want, got = buffer.clone(), buffer.clone()
    copy_rows_reference(want, store, new_pos, changed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fixture sets the interpreter on CPU
    got = got.to(device)
    copy_changed_rows(got, store.to(device), new_pos.to(device), changed.to(device), kernel=True)
    got = got.cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[~changed], buffer[~changed]) and not torch.equal(got, buffer)


def test_the_row_copy_kernel_refuses_a_store_whose_token_rows_are_not_contiguous():
    """The kernel reads a token's row as ``dim`` contiguous elements; a store laid out
    otherwise is refused with the way out named, before anything is launched."""
    store = torch.randn(2, 10, 16)[..., ::2]  # last stride 2
    buffer = torch.zeros(2, 4, 8)
    new_pos, changed = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="kernel=False"):
        copy_changed_rows(buffer, store, new_pos, changed, kernel=True)
    copy_changed_rows(buffer, store, new_pos, changed, kernel=False)  # the indexed copy takes any layout
    assert torch.equal(buffer, store[:, :1].expand(2, 4, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned host memory read by the GPU)")
def test_the_row_copy_reads_a_pinned_host_store_from_the_device():
    """CUDA: the kernel reads the host tier where it lives, pinned host memory (unified
    addressing), into a device buffer: only the changed rows, equal to the indexed copy."""
    gen = torch.Generator().manual_seed(1)
    rows, slots, capacity, dim = 6, 64, 4096, 128
    store = torch.randn(rows, capacity, dim, generator=gen).to(torch.bfloat16).pin_memory()
    new_pos = torch.randint(0, capacity, (rows, slots), generator=gen)
    changed = torch.rand(rows, slots, generator=gen) < 0.3
    want = torch.zeros(rows, slots, dim, dtype=torch.bfloat16)
    copy_rows_reference(want, store, new_pos, changed)
    got = torch.zeros(rows, slots, dim, dtype=torch.bfloat16, device="cuda")
    copy_changed_rows(got, store, new_pos.cuda(), changed.cuda())
    assert torch.equal(got.cpu(), want)


def test_an_empty_selection_moves_nothing():
    pos_of_slot = torch.tensor([[3, -1, 7]])
    new_pos, changed, overflow = plan_slots(pos_of_slot, torch.zeros((1, 0), dtype=torch.long), 10, 10)
    assert new_pos.tolist() == [[3, -1, 7]] and not changed.any() and not bool(overflow)
