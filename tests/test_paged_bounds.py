"""The page rescue over Hugging Face's paged cache (``runtime/paged_bounds.py``, issue 28):
bounds kept per physical page and the rescued candidates of a packed decode step equal the
one-request store's (``runtime/page_bounds.py``) for each request, whatever blocks the
requests got, in what chunks their tokens were written and what the blocks held before."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specontext_compile.runtime import page_bounds
from specontext_compile.runtime.paged_bounds import (PagedLayout, packed_rescue, physical_page, rescue_plan,
                                                     update_bounds, write_plan)
from specontext_compile.runtime.spec import StepSpec

P, KV_HEADS, GROUPS, D = 16, 2, 2, 8
SCALE = D ** -0.5


def _mask(seen: torch.Tensor) -> torch.Tensor:
    """Hugging Face's additive mask ``[1, 1, Q, KV]`` from bool visibility ``[Q, KV]``."""
    return torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]


def _physical_rows(tables: list[list[int]], lengths: list[int], layout: PagedLayout) -> list[torch.Tensor]:
    """Per request, the physical row of each of its tokens (block table, in token order)."""
    return [torch.tensor([tables[i][t // layout.page_size] * layout.stride + t % layout.page_size
                          for t in range(n)]) for i, n in enumerate(lengths)]


def _write_in_chunks(key_view, bounds, rows, keys, chunks, layout, pages):
    """Write every request's keys, a step at a time, each step taking the next ``chunk`` tokens
    of every request still writing (rows of one request consecutive), and update the bounds."""
    done = [0] * len(rows)
    while any(d < len(r) for d, r in zip(done, rows)):
        index, new = [], []
        for i, r in enumerate(rows):
            take = min(chunks[i], len(r) - done[i])
            index.append(r[done[i]:done[i] + take])
            new.append(keys[i][done[i]:done[i] + take])
            done[i] += take
        index, new = torch.cat(index), torch.cat(new)
        key_view.index_copy_(0, index, new)
        mask = _mask(torch.ones(len(index), 1, dtype=torch.bool))
        update_bounds(bounds, key_view, write_plan(index, mask, layout, pages, P))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=4), st.sampled_from([16, 32]), st.integers(1, 5),
       st.lists(st.integers(1, 40), min_size=4, max_size=4), st.integers(0, 2 ** 16))
def test_packed_rescue_equals_each_requests_one_store_rescue(lengths, block_tokens, rescue_pages, chunks, seed):
    gen = torch.Generator().manual_seed(seed)
    per_request = [-(-n // block_tokens) for n in lengths]
    blocks = sum(per_request) + 2
    layout = PagedLayout(page_size=block_tokens, layers=1, blocks=blocks)
    order = torch.randperm(blocks, generator=gen).tolist()  # blocks handed out in any order
    tables, at = [], 0
    for count in per_request:
        tables.append(order[at:at + count])
        at += count
    pages = layout.pages(P)
    # a previous owner's keys and bounds everywhere: nothing of them may leak
    key_view = torch.randn(blocks * layout.stride, KV_HEADS, D, generator=gen) * 5
    bounds = tuple(torch.randn(pages + 1, KV_HEADS, D, generator=gen) for _ in range(2))
    keys = [torch.randn(n, KV_HEADS, D, generator=gen) for n in lengths]
    rows = _physical_rows(tables, lengths, layout)
    _write_in_chunks(key_view, bounds, rows, keys, chunks, layout, pages)

    # one decode row per request, over the packed columns of every request
    starts = torch.tensor([0, *lengths]).cumsum(0)
    kv = int(starts[-1])
    read_index = torch.cat(rows)
    seen = torch.zeros(len(lengths), kv, dtype=torch.bool)
    for i in range(len(lengths)):
        seen[i, starts[i]:starts[i + 1]] = True
    query = torch.randn(1, KV_HEADS * GROUPS, len(lengths), D, generator=gen)
    slots = 6
    columns = torch.full((len(lengths), KV_HEADS, slots), -1)
    for i, n in enumerate(lengths):
        for h in range(KV_HEADS):
            picked = torch.randperm(n, generator=gen)[:slots].sort().values + starts[i]
            columns[i, h, slots - len(picked):] = picked
    spec = StepSpec(budget=slots, candidate_slots=slots, rescue_tokens=rescue_pages * P, page_tokens=P)
    plan = rescue_plan(columns, read_index, _mask(seen), P, layout)
    got = packed_rescue(query, columns, plan, bounds, spec, SCALE)
    page_starts = -(-kv // P) + len(lengths)  # the static bound on the step's pages
    assert got.shape == (len(lengths), KV_HEADS, slots + min(rescue_pages, page_starts) * P)
    assert torch.equal(got[..., :slots], columns)  # the candidates as given, first

    for i, n in enumerate(lengths):
        store = keys[i].permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, n, D]
        count = page_bounds.page_count(n, P)
        lo, hi = torch.zeros(1, KV_HEADS, count, D), torch.zeros(1, KV_HEADS, count, D)
        page_bounds.update_page_bounds(store, lo, hi, torch.tensor(n), n, P)
        visible = torch.ones(1, 1, n, dtype=torch.bool)
        scores = page_bounds.page_scores(query[:, :, i:i + 1], lo, hi, visible, SCALE, P)
        mine = torch.where(columns[i] >= 0, columns[i] - starts[i], -1).unsqueeze(0)
        want = page_bounds.rescued_candidates(mine, scores, visible, min(rescue_pages, count), P)[0]
        for h in range(KV_HEADS):
            ours = got[i, h][got[i, h] >= 0] - starts[i]
            assert sorted(ours.tolist()) == sorted(want[h][want[h] >= 0].tolist()), (i, h)
        # the cache's bounds of this request's pages equal its store's
        first_rows = rows[i][::P]
        page = physical_page(first_rows, layout, P)
        assert torch.equal(bounds[0][page], lo[0].transpose(0, 1)[:len(first_rows)])
        assert torch.equal(bounds[1][page], hi[0].transpose(0, 1)[:len(first_rows)])


def test_a_page_is_one_physical_unit_of_its_block():
    layout = PagedLayout(page_size=32, layers=3, blocks=4)  # stride 192 rows per block
    rows = torch.tensor([0, 15, 16, 31, 192, 192 + 17, 3 * 192 + 31])
    assert physical_page(rows, layout, P).tolist() == [0, 0, 1, 1, 2, 3, 7]
    assert layout.pages(P) == 8
