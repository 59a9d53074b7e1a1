"""Graph breaks inside the decode step (issue 14 item 4): the step's first graph makes the
selection and keeps it in the cache's ``selection_state``; every later graph (its first
retrieval anchor is at a KV layer > 0) reads it back, so every site is rewritten and the
step selects exactly as if it were one graph."""

import pytest
import torch

import specontext_compile as sc
from specontext_compile.backend import compile_reports
from specontext_compile.tiny_models import tiny_family

SMALL = {"budget": 12, "recent_window": 3, "sink_tokens": 2, "inner": "eager"}
PROMPT, STEPS = 30, 6


def _decode(forward, cache, ids, mask=False):
    """Prefill + STEPS greedy steps; last-token logits of every call. ``mask``: pass an
    all-ones attention mask (OPT then traces the step as one graph)."""
    out = []
    with torch.no_grad():
        kw = {"attention_mask": torch.ones_like(ids)} if mask else {}
        logits = forward(input_ids=ids, cache=cache, use_cache=True, **kw).logits[:, -1]
        out.append(logits)
        length = ids.shape[1]
        for _ in range(STEPS):
            length += 1
            kw = {"attention_mask": torch.ones(ids.shape[0], length, dtype=torch.long)} if mask else {}
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True,
                             **kw).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def _decode_reports(before):
    return [r for r in compile_reports() if id(r) not in before and r.result.phase == "decode"]


def _break_before_layer(model, index):
    """An artificial graph break right before decoder layer ``index``."""
    def hook(module, args, kwargs):
        torch._dynamo.graph_break()
    return model.model.layers[index].register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("options", [dict(SMALL, retrieval_layers=(0,)),
                                     pytest.param(dict(SMALL, retrieval_layers=(0,), candidates=2.0),
                                                  marks=pytest.mark.slow)], ids=["shared", "two-stage"])
def test_an_artificial_break_selects_exactly_as_one_graph(options):
    """Retrieval layer 0 (before the break) drives both runs: the selection is made in the
    step's first graph, from the retrieval layers it holds."""
    model = tiny_family("llama", "sdpa")  # 2 layers
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    whole = sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1)
    want = _decode(torch.compile(model.forward, backend="specontext", options=options), whole, ids)
    torch._dynamo.reset()
    handle = _break_before_layer(model, 1)
    before = {id(r) for r in compile_reports()}
    split = sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1)
    got = _decode(torch.compile(model.forward, backend="specontext", options=options), split, ids)
    handle.remove()
    reports = _decode_reports(before)
    assert len(reports) >= 2  # the step really ran as two graphs
    assert all(r.sites_rewritten == r.sites_total == 1 for r in reports)
    loads = [n for r in reports for n in r.graph_module.graph.nodes if "load_selection" in str(n.target)]
    stores = [n for r in reports for n in r.graph_module.graph.nodes if "store_selection" in str(n.target)]
    assert len(loads) >= 1 and len(stores) >= 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert split.path_counts() == whole.path_counts()  # steps counted once, every site counted
    dense = _decode(model.forward, sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1), ids)
    assert (got - dense).abs().max() > 1e-3  # budget 12 of 30+ tokens: really sparse


def test_opt_without_a_mask_is_fully_rewritten_and_equals_the_one_graph_step():
    """OPT without attention_mask breaks the graph inside the step (docs/families.md);
    every site is rewritten and the logits equal the masked, single-graph run."""
    model = tiny_family("opt", "sdpa")
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cap = PROMPT + STEPS + 1
    want = _decode(torch.compile(model.forward, backend="specontext", options=SMALL),
                   sc.SpeContextCache(model.config, max_cache_len=cap), ids, mask=True)
    torch._dynamo.reset()
    before = {id(r) for r in compile_reports()}
    cache = sc.SpeContextCache(model.config, max_cache_len=cap)
    got = _decode(torch.compile(model.forward, backend="specontext", options=SMALL), cache, ids)
    reports = _decode_reports(before)
    assert sum(r.sites_total for r in reports) == sum(r.sites_rewritten for r in reports) >= 2
    assert any(r.result.selections and "load_selection" in str(r.result.selections[0].target) for r in reports)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.path_counts()["gather_sites"] == STEPS * 2


def test_a_sliding_window_model_after_a_break_stays_dense_with_the_reason():
    model = tiny_family("mistral", "sdpa")  # every layer slides
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    handle = _break_before_layer(model, 1)
    before = {id(r) for r in compile_reports()}
    cache = sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1)
    got = _decode(torch.compile(model.forward, backend="specontext", options=SMALL), cache, ids)
    handle.remove()
    reasons = {s.reason for r in _decode_reports(before) for s in r.result.sites if s.reason}
    assert any("sliding windows" in reason for reason in reasons), reasons
    assert torch.isfinite(got).all()


def test_a_break_after_a_dense_by_option_first_part_still_selects_for_the_rest():
    """dense_layers=(0,) with a break before layer 1: the first graph rewrites nothing (layer 0
    stays dense by option) but must still make and store the step's selection, which layer 1
    reads after the break; the split step equals the one-graph step and counts the same
    (one step and one sparse site per decode step)."""
    options = dict(SMALL, retrieval_layers=(0,), dense_layers=(0,))
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    whole = sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1)
    want = _decode(torch.compile(model.forward, backend="specontext", options=options), whole, ids)
    torch._dynamo.reset()
    handle = _break_before_layer(model, 1)
    split = sc.SpeContextCache(model.config, max_cache_len=PROMPT + STEPS + 1)
    got = _decode(torch.compile(model.forward, backend="specontext", options=options), split, ids)
    handle.remove()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    counts = split.path_counts()
    assert counts == whole.path_counts()
    assert counts["decode_steps"] == STEPS and counts["sparse_sites"] == STEPS, counts
    assert int(split.selection_state.max()) >= 0  # a real selection was stored
