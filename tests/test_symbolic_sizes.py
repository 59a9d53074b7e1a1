"""Sizes dynamo makes symbolic on a recompile (issue 52): the batch (tests/test_static_cache.py),
a step's query length, a store's capacity and page count. Wherever host-side state or a
decision of the pass is built from such a size, it is read from the real inputs, from the
graph (a size node), or decided by a guard; never from a traced shape. Each test compares
with the same run compiled with ``dynamic=False`` (static shapes: the reference path) and
asserts the path counters of the step that ran."""

import pytest
import torch
from torch._dynamo.utils import counters

import specontext_compile as sc
from specontext_compile import backend
from specontext_compile.runtime import page_bounds
from specontext_compile.tiny_models import tiny_family

SMALL = {"budget": 12, "recent_window": 3, "sink_tokens": 2, "inner": "eager"}


@pytest.fixture
def model():
    return tiny_family("llama", "sdpa")


def _multi_token_steps(model, dynamic, lengths, **options):
    """A 40-token prompt, then steps of ``lengths`` tokens on one SpeContextCache; per step:
    (logits, gather sites it ran)."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 128, (1, 40), generator=g)
    steps = [torch.randint(0, 128, (1, n), generator=g) for n in lengths]
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(SMALL, **options), dynamic=dynamic)
    cache = sc.SpeContextCache(model.config, max_cache_len=96)
    out = []
    with torch.no_grad():
        forward(input_ids=prompt, cache=cache, use_cache=True)
        for ids in steps:
            before = cache.path_counts()["gather_sites"]
            logits = forward(input_ids=ids, cache=cache, use_cache=True).logits
            out.append((logits, cache.path_counts()["gather_sites"] - before))
    return out


def test_declared_multi_token_steps_run_sparse_when_dynamo_makes_their_length_symbolic(model):
    """``max_sparse_q_len=8`` with the default ``torch.compile`` (no ``dynamic=False``):
    after a 40-token prompt, the step of 3 tokens makes dynamo trace the query length
    symbolic. Each step of 2..8 tokens runs sparse (2 layers gathered, path counters), with
    the logits of the same steps compiled with static shapes (bit-equal: same graph after
    the guard; asserted at 1e-6); the 9-token step stays dense by design (0 gathers) and
    equals the static run too; the budget is below the context, so sparse differs from
    dense (> 1e-3)."""
    lengths = (3, 4, 1, 5, 2, 8, 9)
    counters.clear()
    got = _multi_token_steps(model, None, lengths, max_sparse_q_len=8)
    decided = counters["specontext"]
    want = _multi_token_steps(model, False, lengths, max_sparse_q_len=8)
    for n, (logits, gathered), (ref, ref_gathered) in zip(lengths, got, want):
        assert gathered == (2 if n <= 8 else 0), (n, gathered)
        assert ref_gathered == gathered
        torch.testing.assert_close(logits, ref, atol=1e-6, rtol=0)
    assert decided["symbolic_query_len_dense"] == 0
    dense = _multi_token_steps(model, False, lengths, max_sparse_q_len=8, budget=4096)
    assert max((a[0][:, -1] - d[0][:, -1]).abs().max().item() for a, d in zip(got, dense)) > 1e-3


def test_without_a_declaration_symbolic_lengths_are_prefill(model):
    """``max_sparse_q_len=1`` (the default): multi-token steps stay dense whatever their
    shapes (no guard is added, nothing is decided), one-token steps gather."""
    got = _multi_token_steps(model, None, (3, 4, 1), max_sparse_q_len=1)
    assert [g for _, g in got] == [0, 0, 2]


def test_page_shift_is_set_when_the_capacity_is_symbolic(model):
    """A second SpeContextCache of another length (stores allocated up front, as chunked
    prefill and export do, so they are graph inputs) makes dynamo trace the store's capacity
    (and its page count) symbolic; the prompt's left padding still sets each row's page
    shift (read in the graph from the store's size), exactly as on the first cache: row 0
    with 15 pads gets the shift that starts a page at its 16th position, row 1 none."""
    g = torch.Generator().manual_seed(9)
    pad = 15
    ids = torch.randint(1, 128, (2, 41), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    torch._dynamo.reset()
    backend.clear_compile_reports()
    forward = torch.compile(model.forward, backend="specontext", options=dict(budget=10, inner="eager"))
    want = [int(page_bounds.row_shift(torch.tensor(pad), 16)), 0]
    for capacity in (48, 64, 80):
        cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
        cache.early_initialization(2, 2, 16, torch.float32, torch.device("cpu"))  # stores enter as inputs
        with torch.no_grad():
            forward(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        assert cache.page_shift.tolist() == want, capacity
    stores = [n.meta["example_value"] for r in backend.compile_reports() for n in r.graph_module.graph.nodes
              if n.op == "placeholder" and "key" in n.name and n.meta.get("example_value") is not None
              and getattr(n.meta["example_value"], "dim", lambda: 0)() == 4]
    assert any(isinstance(s.shape[2], torch.SymInt) for s in stores)  # the class at stake ran
