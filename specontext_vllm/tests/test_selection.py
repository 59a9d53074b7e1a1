"""The plugin's selection of each decode row against a float64 reference written out plainly:
per row and KV head, the summed group-max softmax of the retrieval layers' recorded previous
queries over the row's past tokens, a block's score the max over its tokens; kept: the sink
blocks, the blocks of the recent window (the current one included) and the top-scored blocks,
``budget // block_size`` in all. Rows of different lengths batched together select as each
would alone; the kernel's inputs (block tables, lengths) follow; a stale or missing record
ranks by recency."""

import sys

import pytest
import torch
from vllm import _custom_ops as ops

from specontext_vllm.int8_keys import Int8Keys
from specontext_vllm.layout import probe_layout
from specontext_vllm.options import PluginOptions
from specontext_vllm.selection import block_counts, previous_slots, select_blocks
from specontext_vllm.state import LaggedQueries

HEADS, KV, D, BLOCK = 4, 2, 64, 32
OPTIONS = PluginOptions(budget=4 * BLOCK, sink_tokens=2, recent_window=40, retrieval_layers=None)


def _paged(lengths, layers, seed):
    """Caches of ``layers`` retrieval layers holding ``lengths[r] - 1`` past tokens per row,
    records with each row's previous query, and the float64 keys and queries."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [(n + BLOCK - 1) // BLOCK for n in lengths]
    blocks = sum(per_row) + 2
    order = torch.randperm(blocks, generator=gen)
    table = torch.zeros(len(lengths), max(per_row), dtype=torch.int32)
    used = 0
    for r, k in enumerate(per_row):
        table[r, :k] = order[used:used + k]
        used += k
    caches, records, keys, queries = [], [], [], []
    for _ in range(layers):
        cache = torch.zeros(blocks, KV, BLOCK, 2 * D)
        key_area, value_area = cache.view(blocks, KV, 2 * BLOCK, D).chunk(2, dim=2)
        record = LaggedQueries.for_cache(cache, HEADS, D)
        row_keys, row_queries = [], []
        for r, n in enumerate(lengths):
            k = torch.randn(n - 1, KV, D, generator=gen)
            slots = table[r, torch.arange(n - 1) // BLOCK].long() * BLOCK + torch.arange(n - 1) % BLOCK
            ops.cpu_attn_reshape_and_cache(k, k, key_area, value_area, slots, "vec")
            q = torch.randn(HEADS, D, generator=gen) * 2
            record.write(q[None], slots[-1:])  # the previous token's query, in its block
            # this step's slot holds garbage until the layer writes it (a block's earlier tenant)
            own = table[r, (n - 1) // BLOCK].long().view(1) * BLOCK + (n - 1) % BLOCK
            garbage = (q.view(KV, -1, D).sum(1) * 50)[None]
            ops.cpu_attn_reshape_and_cache(garbage, garbage, key_area, value_area, own, "vec")
            row_keys.append(k.double())
            row_queries.append(q.double())
        caches.append(cache)
        records.append(record)
        keys.append(row_keys)
        queries.append(row_queries)
    return caches, records, table, keys, queries


def _reference(keys, queries, r, n, scale):
    """The float64 selection of row ``r`` (``n`` tokens, this step's included): per KV head, the
    set of logical blocks kept."""
    total = torch.zeros(KV, n - 1, dtype=torch.float64)
    for layer_keys, layer_queries in zip(keys, queries):
        k, q = layer_keys[r], layer_queries[r]  # [n-1, KV, D], [HEADS, D]
        logits = torch.einsum("kgd,nkd->kgn", q.view(KV, -1, D), k) * scale
        total += logits.softmax(-1).amax(1)
    blocks = (n + BLOCK - 1) // BLOCK
    kept, sinks, recent = block_counts(OPTIONS, BLOCK)
    if blocks <= kept:
        return [set(range(blocks))] * KV
    forced = set(range(sinks)) | set(range(blocks - recent, blocks))
    out = []
    for h in range(KV):
        score = [float(total[h, b * BLOCK:(b + 1) * BLOCK].max()) for b in range(blocks - 1)]  # the current block: forced
        ranked = [b for b in sorted(range(blocks - 1), key=lambda b: -score[b]) if b not in forced]
        out.append(forced | set(ranked[: kept - len(forced)]))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("path", ["one-call", "per-layer"])
def test_each_row_selects_as_the_float64_reference(seed, path, monkeypatch):
    """Both scoring paths: the C++ kernel's one call over the layers, and the per-layer torch
    path (a packing the kernel does not read); the counted calls say which ran."""
    from specontext_vllm import kernels

    calls = []
    real = kernels.paged_lagged_scores
    monkeypatch.setattr(kernels, "paged_lagged_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    if path == "per-layer":
        monkeypatch.setattr(kernels, "FORM_CODES", {})
    lengths = [297, 40, 450, 128]  # rows of 10, 2, 15 and 4 blocks (kept: 4 blocks)
    caches, records, table, keys, queries = _paged(lengths, 3, seed)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    layout = probe_layout("vec", torch.float32, BLOCK, D)
    selection = select_blocks(records, caches, table, seq_lens, layout, OPTIONS, D**-0.5)
    assert len(calls) == (1 if path == "one-call" else 0)
    assert int(selection.recency_rows) == 0 and selection.logical.shape == (4, KV, 4)
    for r, n in enumerate(lengths):
        want = _reference(keys, queries, r, n, D**-0.5)
        for h in range(KV):
            got = selection.logical[r, h]
            got = got[got >= 0]
            assert set(got.tolist()) == want[h], (r, h)
            assert (got.diff() > 0).all()  # ascending: the current block last
            assert torch.equal(selection.tables[r, h, :len(got)], table[r, got].int())
            # whole blocks, then the current block's tokens (this step's included)
            assert int(selection.seq_lens[r, h]) == (len(got) - 1) * BLOCK + (n - 1) % BLOCK + 1


def test_a_stale_record_ranks_by_recency():
    lengths = [297, 450]
    caches, records, table, _, _ = _paged(lengths, 2, 0)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    stale = previous_slots(table, seq_lens, BLOCK)[1]
    records[1].stamps[stale // BLOCK] = stale - 1  # row 1's block now holds another token's query
    layout = probe_layout("vec", torch.float32, BLOCK, D)
    selection = select_blocks(records, caches, table, seq_lens, layout, OPTIONS, D**-0.5)
    assert int(selection.recency_rows) == 1
    blocks = (450 + BLOCK - 1) // BLOCK
    recent = {0} | set(range(blocks - 3, blocks))  # the sink block and the most recent ones
    assert all(set(selection.logical[1, h].tolist()) == recent for h in range(KV))
    nothing = select_blocks(None, caches, table, seq_lens, layout, OPTIONS, D**-0.5)
    assert int(nothing.recency_rows) == 2 and torch.equal(nothing.logical[1], selection.logical[1])


def test_a_reused_block_never_lends_its_query():
    cache = torch.zeros(4, KV, BLOCK, 2 * D)
    record = LaggedQueries.for_cache(cache, HEADS, D)
    record.write(torch.ones(1, HEADS, D), torch.tensor([2 * BLOCK + 5]))
    query, ok = record.read(torch.tensor([2 * BLOCK + 5, 2 * BLOCK + 6, -1]))
    assert ok.tolist() == [True, False, False] and torch.equal(query[0], torch.ones(HEADS, D))


def test_padding_slots_never_record_a_query():
    """vLLM's padding rows (negative slots) in a write land in the record's spare row: no block
    takes their query or stamp, and a read of any real slot never sees them."""
    cache = torch.zeros(4, KV, BLOCK, 2 * D)
    record = LaggedQueries.for_cache(cache, HEADS, D)
    rows = torch.arange(3 * HEADS * D, dtype=torch.float32).view(3, HEADS, D)
    record.write(rows, torch.tensor([-1, BLOCK + 3, -1]))
    assert record.stamps[:4].tolist() == [-1, BLOCK + 3, -1, -1]
    assert torch.equal(record.queries[1], rows[1]) and bool((record.queries[[0, 2, 3]] == 0).all())
    every_slot = torch.arange(4 * BLOCK)
    _, ok = record.read(every_slot)
    assert ok.nonzero().flatten().tolist() == [BLOCK + 3]


# --- option selection_keys="int8" (the default): the retrieval layers' int8 keys -------------


def _int8_copies(caches, table, lengths, keys):
    """Each layer's :class:`Int8Keys` holding the rows of the keys ``_paged`` wrote (the
    current slot's garbage included, as vLLM's cache holds it), written as the backend writes
    them: all of a row's slots in one call, and a padding slot among them."""
    copies = []
    for cache, layer_keys in zip(caches, keys):
        copy = Int8Keys.for_cache(cache, D)
        for r, n in enumerate(lengths):
            slots = table[r, torch.arange(n - 1) // BLOCK].long() * BLOCK + torch.arange(n - 1) % BLOCK
            copy.write(torch.cat([layer_keys[r].float(), torch.randn(1, KV, D)]), torch.cat([slots, torch.tensor([-1])]))
        copies.append(copy)
    return copies


def _int8_reference_scores(copies, table, queries, r, n, scale):
    """float64 ``[KV, n - 1]``: the lagged-query scores of row ``r`` over the dequantized int8
    keys, the scaled query rows (float32) rounded to int8 rows too, as the backend's int8
    selection scores (levels x scale in float64)."""
    from specontext_compile.runtime.int8_keys import quantize_rows

    total = torch.zeros(KV, n - 1, dtype=torch.float64)
    for copy, layer_queries in zip(copies, queries):
        pos = torch.arange(n - 1)
        block, offset = table[r, pos // BLOCK].long(), pos % BLOCK
        k = copy.levels[block, :, offset].double() * copy.scales[block, :, offset].double().unsqueeze(-1)
        q_levels, q_scales = quantize_rows((layer_queries[r].float() * scale).view(KV, -1, D))
        q = q_levels.double() * q_scales.double().unsqueeze(-1)
        total += torch.einsum("kgd,nkd->kgn", q, k).softmax(-1).amax(1)
    return total


def test_int8_rows_are_the_backends_rounding_of_the_keys_written():
    """Each written slot holds ``quantize_rows`` of its key (the backend's rounding); padding
    slots touch no block; slots never written stay zero."""
    from specontext_compile.runtime.int8_keys import quantize_rows

    cache = torch.zeros(4, KV, BLOCK, 2 * D)
    copy = Int8Keys.for_cache(cache, D)
    keys = torch.randn(3, KV, D) * torch.tensor([1.0, 30.0, 1e-3]).view(3, 1, 1)
    slots = torch.tensor([BLOCK + 3, -1, 3 * BLOCK + 31])
    copy.write(keys, torch.cat([slots, torch.tensor([-1, -1])]))  # vLLM's slot mapping may be longer
    levels, scales = quantize_rows(keys)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(copy.levels[slot // BLOCK, :, slot % BLOCK], levels[i])
        assert torch.equal(copy.scales[slot // BLOCK, :, slot % BLOCK], scales[i])
    written = torch.zeros(4, BLOCK, dtype=torch.bool)
    written[1, 3] = written[3, 31] = True
    assert not bool(copy.levels[:4].permute(0, 2, 1, 3)[~written].any())
    assert not bool(copy.scales[:4].permute(0, 2, 1)[~written].any())
    assert copy.fits(cache) and not copy.fits(torch.zeros(5, KV, BLOCK, 2 * D))


@pytest.mark.parametrize("heads", [4, 6])  # 2 query heads a KV head: the generic loop; 3 x 64: the vector path
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_int8_scores_are_the_float64_scores_of_the_int8_keys(heads, path, take_path, monkeypatch):
    """The scores of every row over the dequantized int8 keys and query rows, against float64
    (float32 arithmetic: within 2e-5 of the summed weights); the path that ran is counted, and
    on a CPU with AVX-512 VNNI the 3 x 64 group takes the int8 dot products."""
    from specontext_compile.runtime.cpu_kernels import _cpu_flags
    from specontext_vllm import kernels
    from specontext_vllm import selection as selection_module

    monkeypatch.setattr(sys.modules[__name__], "HEADS", heads)
    calls = take_path(path, "available", "paged_lagged_scores_int8")
    lengths = [297, 40, 450, 129]
    caches, records, table, keys, queries = _paged(lengths, 3, 5)
    copies = _int8_copies(caches, table, lengths, keys)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    blocks = -(-max(lengths) // BLOCK)
    slots = previous_slots(table, seq_lens, BLOCK)
    reads = [record.read(slots)[0] for record in records]
    past = (seq_lens.long() - 1).clamp(min=0)
    dots = kernels.int8_dot_calls() if path == "kernel" else 0
    got = selection_module._int8_scores(copies, table, blocks, reads, D**-0.5, past, torch.float32)
    assert len(calls) == (1 if path == "kernel" else 0)
    if path == "kernel":
        vnni = " avx512_vnni" in _cpu_flags() and " avx512bw" in _cpu_flags()
        assert kernels.int8_dot_calls() - dots == (1 if heads == 6 and vnni else 0)
    for r, n in enumerate(lengths):
        want = _int8_reference_scores(copies, table, queries, r, n, D**-0.5)
        torch.testing.assert_close(got[r, :, : n - 1].double(), want, atol=2e-5, rtol=0)
        assert not bool(got[r, :, n - 1:].any())  # not a past position: no weight


def test_the_int8_selection_reads_the_copies_not_the_cache():
    """With ``copies`` the selection is the float64 one over the int8 keys even when vLLM's
    cache holds other keys (here: zeros); without them it reads the cache."""
    lengths = [297, 450]
    caches, records, table, keys, queries = _paged(lengths, 2, 3)
    copies = _int8_copies(caches, table, lengths, keys)
    for cache in caches:
        cache.zero_()
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    layout = probe_layout("vec", torch.float32, BLOCK, D)
    options = PluginOptions(budget=8 * BLOCK, sink_tokens=2, recent_window=40, retrieval_layers=None)
    kept, sinks, recent = block_counts(options, BLOCK)  # 8 blocks: 4 forced, 4 by score
    selection = select_blocks(records, caches, table, seq_lens, layout, options, D**-0.5, copies)
    flat = select_blocks(records, caches, table, seq_lens, layout, options, D**-0.5)
    for r, n in enumerate(lengths):
        scores = _int8_reference_scores(copies, table, queries, r, n, D**-0.5)
        blocks = (n + BLOCK - 1) // BLOCK
        forced = set(range(sinks)) | set(range(blocks - recent, blocks))
        for h in range(KV):
            score = [float(scores[h, b * BLOCK:(b + 1) * BLOCK].max()) for b in range(blocks - 1)]
            ranked = [b for b in sorted(range(blocks - 1), key=lambda b: -score[b]) if b not in forced]
            got = selection.logical[r, h]
            assert set(got[got >= 0].tolist()) == forced | set(ranked[: kept - len(forced)]), (r, h)
    assert not torch.equal(selection.logical, flat.logical)  # zeroed keys score flat: another selection
