"""Every selection head through the same checks (issue 53, item 4; ``runtime/scorers.py``).

A head is a scorer: ``score`` + ``ready`` in plain torch, behind the one selection node
``scorers.head_select`` the pass inserts for whichever head. Each test here runs every head
(the lagged-query default, an embedding-only draft head, a fused draft head) on a tiny random
Llama (4 layers, 6 query / 2 KV heads), fp32, the op chain run eagerly (``inner="eager"``,
``lower=False``: the spies see every call):

* exact at full budget: logits equal eager dense attention (observed <= 3e-7; bound 1e-4) on
  the gather path (path counters), the graph holding one ``head_select`` of that head;
* sparse at a small budget: each step's selection is sinks + recent window + the top of the
  head's scores (the host reference ``select_tokens``), and those scores equal a float64
  computation of the head's definition from the same record (1e-5);
* the head's state follows ``crop`` and ``reorder_cache``: the next steps' logits equal a fresh
  cache's fed the same tokens (1e-5), with no recency fallback.
"""

import functools
import sys
from pathlib import Path

import pytest
import torch
from _tiny import decode_graph_ops, tiny_llama
from specontext_compile.runtime import scorers
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from test_backend_e2e import assert_gather_path, decode_logits
from test_draft_head_backend import write_head
from transformers import DynamicCache

import specontext_compile as sc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks.host_selection import select_tokens

ATOL = 1e-5
SMALL = {"budget": 12, "recent_window": 3, "sink_tokens": 2, "page_rescue": 0}
HEADS = ["lagged-query", "draft-embedding", "draft-fused"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=4)


@pytest.fixture(params=HEADS)
def head(request, model, tmp_path):
    """``(scorer name, backend options, cache factory)`` of one head."""
    if request.param == "lagged-query":
        return "lagged-query", {"inner": "eager", "lower": False}, functools.partial(
            sc.SpeContextCache, model.config, max_cache_len=64)
    variant = request.param.split("-")[1]
    folder = write_head(tmp_path, model, heads=4, kv_heads=2, variant=variant)
    return "draft", {"inner": "eager", "lower": False, "retrieval_head": str(folder)}, functools.partial(
        sc.SpeContextCache, model.config, max_cache_len=64, retrieval_head=str(folder))


def _tokens(seed, shape):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def _feed(forward, cache, ids):
    """Logits of the last position of each call, ``ids`` ``[batch, n]`` fed one token a call."""
    with torch.no_grad():
        return torch.stack([forward(input_ids=t, past_key_values=cache, use_cache=True).logits[:, -1]
                            for t in ids.split(1, dim=1)], 1)


def _prefill(forward, cache, ids):
    with torch.no_grad():
        forward(input_ids=ids, past_key_values=cache, use_cache=True)


def test_every_head_is_exact_at_full_budget(model, head):
    name, options, cache_of = head
    ids = _tokens(0, (1, 37))
    eager = decode_logits(model, model.forward, ids, 8, DynamicCache(config=model.config))
    forward = torch.compile(model.forward, backend="specontext",
                            options=dict(options, budget=64, dense_shortcut=False))
    cache = cache_of()
    got = decode_logits(model, forward, ids, 8, cache)
    for step, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert_gather_path(cache, 4 * 8)
    assert cache.path_counts()["recency_fallback_steps"] == 0
    assert decode_graph_ops("head_select", name) == 1 and decode_graph_ops("head_select") == 1


def _reference_scores(name, record, stores, cached, q_len, scale):
    """The head's definition in float64 from its record (positions the step may not see: 0)."""
    capacity = stores[0].shape[-2]
    if name == "lagged-query":
        state, _ = record
        queries, layers = state.double(), stores
    else:  # a draft head scores its own keys, causal over the step's tokens, with its own scale
        query, draft_keys, _ = record
        queries, layers = query.double()[None], [draft_keys[:, :, :capacity]]
        cached, scale = cached + q_len, query.shape[-1] ** -0.5
    total = 0
    for q, keys in zip(queries, layers):
        b, kv, _, d = keys.shape
        logits = torch.einsum("bkgd,bknd->bkgn", q.reshape(b, kv, -1, d), keys.double()) * scale
        logits[..., int(cached):] = float("-inf")
        total = total + logits.softmax(-1).amax(2)
    return torch.nan_to_num(total, nan=0.0)


def test_every_head_selects_the_top_of_its_scores(model, head, monkeypatch):
    """Budget 12 of a 40-token prompt, 6 steps: each ``head_select`` call keeps sinks, recent
    window and the top of the head's scores; the scores equal the float64 definition."""
    name, options, cache_of = head
    calls = []
    real = scorers.head_select

    def snapshot(a):  # the record, stores and length change in place at later steps
        if isinstance(a, torch.Tensor):
            return a.clone()
        return type(a)(map(snapshot, a)) if isinstance(a, (list, tuple)) else a

    @functools.wraps(real)
    def spy(*args):
        out = real(*args)
        calls.append((snapshot(args), out))
        return out

    monkeypatch.setattr(scorers, "head_select", spy)  # before compiling: the pass inserts what it finds
    forward = torch.compile(model.forward, backend="specontext", options=dict(options, **SMALL))
    cache = cache_of()
    _prefill(forward, cache, _tokens(1, (1, 40)))
    _feed(forward, cache, _tokens(2, (1, 6)))
    assert len(calls) == 6
    assert_gather_path(cache, 4 * 6)
    assert cache.path_counts()["recency_fallback_steps"] == 0
    for step, ((head_name, record, stores, length, q_len, spec, variant, _mask, bias), kept) in enumerate(calls):
        assert head_name == name and bias is None
        scores = scorers.SCORERS[name].score(record, stores, length, q_len, None, variant, bias)
        want = _reference_scores(name, record, stores, length, q_len, variant.scale)
        torch.testing.assert_close(scores.double(), want, atol=ATOL, rtol=ATOL, msg=f"step {step}")
        assert bool(scorers.head_ready(name, record, stores, length, q_len))
        total = int(length) + q_len
        expected = select_tokens(scores, total, q_len, SMALL["budget"], SMALL["sink_tokens"], SMALL["recent_window"])
        torch.testing.assert_close(kept, expected, msg=f"step {step}")
        assert (kept >= 0).all() and kept.shape[-1] == SMALL["budget"] < total  # sparse: 12 of 41..46


def test_every_heads_state_follows_a_crop(model, head):
    """Prompt, 6 tokens, ``crop(-3)``, 4 other tokens: the 4 steps equal a fresh cache's fed the
    prompt, the 3 kept tokens and the same 4 (logits 1e-5, path counts equal, no recency)."""
    _, options, cache_of = head
    forward = torch.compile(model.forward, backend="specontext", options=dict(options, **SMALL))
    prompt, drafts, others = _tokens(1, (1, 40)), _tokens(2, (1, 6)), _tokens(3, (1, 4))
    cropped, fresh = cache_of(), cache_of()
    _prefill(forward, cropped, prompt)
    _feed(forward, cropped, drafts)
    cropped.crop(-3)
    before = cropped.path_counts()
    got = _feed(forward, cropped, others)
    _prefill(forward, fresh, prompt)
    _feed(forward, fresh, drafts[:, :3])
    fresh_before = fresh.path_counts()
    want = _feed(forward, fresh, others)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    steps = {k: v - before[k] for k, v in cropped.path_counts().items()}
    assert steps == {k: v - fresh_before[k] for k, v in fresh.path_counts().items()}
    assert steps["gather_sites"] == 4 * 4 and steps["recency_fallback_steps"] == 0, steps


def test_every_heads_state_follows_a_reorder(model, head):
    """Two rows, 3 steps, ``reorder_cache([1, 0])`` (a beam search's swap), 3 more steps: equal to
    a cache prefilled with the rows swapped and fed the same tokens (logits 1e-5)."""
    _, options, cache_of = head
    forward = torch.compile(model.forward, backend="specontext", options=dict(options, **SMALL))
    prompts, first, then = _tokens(4, (2, 40)), _tokens(5, (2, 3)), _tokens(6, (2, 3))
    swap = torch.tensor([1, 0])
    reordered, fresh = cache_of(), cache_of()
    _prefill(forward, reordered, prompts)
    _feed(forward, reordered, first)
    reordered.reorder_cache(swap)
    got = _feed(forward, reordered, then)
    _prefill(forward, fresh, prompts[swap])
    _feed(forward, fresh, first[swap])
    want = _feed(forward, fresh, then)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    counts, fresh_counts = reordered.path_counts(), fresh.path_counts()
    assert counts["recency_fallback_steps"] == 0
    assert counts["gather_sites"] == fresh_counts["gather_sites"] == 4 * 6  # every site of the 6 steps gathered


def test_an_unknown_head_is_refused_with_the_known_names():
    keys = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"no selection head named 'nope'.*draft.*lagged-query"):
        scorers.head_select("nope", (), [keys], torch.tensor(4), 1, StepSpec(4, 4), AttentionVariant(0.5))
