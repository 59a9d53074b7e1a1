"""Option ``dense_layers`` (issue 12): chosen decoder layers keep exact dense decode attention
(their sites are not rewritten) while the others stay sparse; the path counters say which ran."""

from __future__ import annotations

import logging

import pytest
import torch
from _tiny import compiled_steps

import specontext_compile as sc
from specontext_compile.backend import clear_compile_reports, compile_reports
from specontext_compile.tiny_models import tiny_family

OPTS = {"budget": 6, "sink_tokens": 1, "recent_window": 1}  # the default step (lowered, inductor)
# the op chain, for tests whose subject is a warning the pass logs while rewriting (the same
# under either inner compiler) and that only read the path counters besides
EAGER_OPTS = dict(OPTS, inner="eager")


def _steps(model, ids, steps, **options):
    logits, cache = compiled_steps(model, ids, steps, **options)
    return logits, cache.path_counts()


def _eager(model, ids, steps):
    logits, seq = [], ids
    with torch.no_grad():
        for _ in range(steps):
            token = model(seq).logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], 1)
            logits.append(model(seq).logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.slow  # the option's fast test is the next one (docs/testing.md)
def test_every_layer_dense_is_the_dense_model_and_nothing_is_rewritten():
    """dense_layers naming every layer: no decode site is rewritten (sparse_sites == 0) and the
    logits are the eager dense model's; the same budget without the option is sparse and differs."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    dense = _eager(model, ids, 3)
    logits, counts = _steps(model, ids, 3, dense_layers=(0, -1), **OPTS)
    assert counts["sparse_sites"] == 0, counts
    torch.testing.assert_close(logits, dense, atol=1e-4, rtol=0)
    sparse, counts = _steps(model, ids, 3, **OPTS)
    assert counts["sparse_sites"] == 3 * len(model.model.layers), counts
    assert (sparse - dense).abs().max() > 1e-3


def test_one_dense_layer_leaves_the_others_sparse():
    """dense_layers=(-1,) on a 2-layer model: layer 1 (and only it) keeps its dense site with
    the option's reason, layer 0 stays sparse (one sparse site a step), and the logits lie
    neither on the all-sparse run nor on the dense model."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    clear_compile_reports()
    one, counts = _steps(model, ids, 3, dense_layers=-1, **OPTS)
    assert counts["sparse_sites"] == 3 and counts["decode_steps"] == 3, counts
    decode = [r for r in compile_reports() if r.result.phase == "decode"]
    reasons = {s.layer: s.reason for r in decode for s in r.result.sites}
    assert reasons[0] is None and "dense_layers" in reasons[1], reasons
    every, _ = _steps(model, ids, 3, **OPTS)
    assert (one - every).abs().max() > 1e-4
    assert (one - _eager(model, ids, 3)).abs().max() > 1e-4


def test_a_layer_the_model_lacks_is_a_warning_and_keeps_nothing_dense(caplog):
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    with caplog.at_level(logging.WARNING, logger="specontext_compile.passes.sparse_rewrite"):
        _, counts = _steps(model, ids, 1, dense_layers=(5, -3), **EAGER_OPTS)
    assert counts["sparse_sites"] == 2, counts
    assert "dense_layers [-3, 5] name no KV layer" in caplog.text and "L = 2" in caplog.text


def test_the_guard_says_where_it_cannot_run(caplog):
    """min_coverage with the rescue alone (candidates=1) on a cache without page bounds: no
    site refines, so none is guarded; a warning says so and names the fix."""
    model = tiny_family("llama", "sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(EAGER_OPTS, min_coverage=0.999))
    cache = sc.SpeContextCache(model.config, max_cache_len=42, page_tokens=0)
    with caplog.at_level(logging.WARNING, logger="specontext_compile.passes.sparse_rewrite"), torch.no_grad():
        out = forward(input_ids=ids, cache=cache, use_cache=True)
        forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert cache.path_counts()["guard_dense_sites"] == 0
    assert "the fidelity guard (min_coverage) is off at 2 decode site(s)" in caplog.text
    assert "candidates=2" in caplog.text


@pytest.mark.parametrize("bad", ["0", 1.5, True, [0, "x"]])
def test_bad_dense_layers_are_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="dense_layers"):
        sc.SpeContextConfig(dense_layers=bad)


def test_dense_layers_are_normalised_and_combine_with_offload():
    """Sorted, deduplicated; with device_memory_bytes accepted (tests/test_offload.py runs it)."""
    assert sc.SpeContextConfig(dense_layers=[2, 0, 2]).dense_layers == (0, 2)
    assert sc.SpeContextConfig(dense_layers=0, device_memory_bytes=1 << 30).dense_layers == (0,)


def test_resident_layer_indices_resolve_negative_and_missing_layers():
    from specontext_compile.runtime.offload import resident_layer_indices

    assert resident_layer_indices((-1, 0, 7, 0), 3) == (0, 2)  # 7: no such layer, left out
    assert resident_layer_indices(1, 3) == (1,) and resident_layer_indices((), 3) == ()
    with pytest.raises(ValueError, match="all 3 layers dense"):
        resident_layer_indices((0, 1, -1), 3)


@pytest.mark.parametrize("budget", [64, 8])
def test_a_step_whose_sites_all_read_their_whole_store_makes_no_selection(budget):
    """Budget 64 covers the cache (capacity 31): every decode site takes the dense shortcut, so
    the step leaves the selection out (no ``head_select``, sites fed ``every_slot``) and
    equals the eager dense model (float32, 1e-4); budget 8 of the same cache selects and
    gathers (the negative case: the selection stays where a site reads it)."""
    from _tiny import decode_graph_ops

    model = tiny_family("llama", "sdpa")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    clear_compile_reports()
    logits, counts = _steps(model, ids, 6, budget=budget, sink_tokens=1, recent_window=1)
    decode = [r for r in compile_reports() if r.result.phase == "decode"]
    assert decode and all(r.result.selection_inserted == (budget < 31) for r in decode)
    assert (decode_graph_ops("head_select") > 0) == (budget < 31)
    assert (decode_graph_ops("every_slot") > 0) == (budget >= 31)
    layers = model.config.num_hidden_layers
    if budget >= 31:
        assert counts["dense_store_sites"] == counts["sparse_sites"] == 6 * layers, counts
        torch.testing.assert_close(logits, _eager(model, ids, 6), atol=1e-4, rtol=1e-4)
    else:
        assert counts["gather_sites"] == 6 * layers and counts["dense_store_sites"] == 0, counts
