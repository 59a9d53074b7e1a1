"""Option ``freezing=True`` folds the weights into the graph inductor freezes (specontext_compile/freezing.py).

Without the fold, dynamo hands every parameter to the backend as a graph input and inductor's
freezing patch changes nothing; these tests check that the fold happens where it must (and
only there), that a frozen step computes what the unfrozen one does, and that the graph handed
to inductor has no parameter among its inputs (the fold itself; that inductor then packs the
weights is inductor's freezing, measured in docs/benchmarks.md, not asserted here)."""

from __future__ import annotations

import torch
from torch import fx
from torch._dynamo.utils import counters

from _tiny import compiled_steps, tiny_llama
from specontext_compile.freezing import drop_folded, fold_parameters

IDS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))


def test_a_frozen_step_computes_the_unfrozen_steps_logits():
    """``freezing=True`` (whole-graph compile, weights folded): one frozen graph per compiled
    decode graph, and logits within 1e-5 of the default step's (same arithmetic; inductor may
    fold constants and reorder sums)."""
    model = tiny_llama(layers=2)
    plain, _ = compiled_steps(model, IDS, 3, budget=8)
    counters.clear()
    frozen, _ = compiled_steps(model, IDS, 3, budget=8, freezing=True)
    assert counters["specontext"]["frozen_graphs"] >= 1
    assert counters["specontext"]["regions"] == 0  # a frozen graph is compiled whole
    torch.testing.assert_close(frozen, plain, atol=1e-5, rtol=0)


def test_no_fold_by_default_nor_with_gradients_on():
    """The default options (regional compile: the weights are the shared regions' inputs) and
    ``freezing=True`` traced with gradients on (inductor does not freeze then) fold nothing."""
    model = tiny_llama(layers=2)
    counters.clear()
    compiled_steps(model, IDS, 1, budget=8)
    assert counters["specontext"]["frozen_graphs"] == 0
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options={"budget": 8, "freezing": True})
    import specontext_compile as sc

    cache = sc.SpeContextCache(model.config, max_cache_len=IDS.shape[1] + 2)
    out = forward(input_ids=IDS, cache=cache, use_cache=True)
    forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert counters["specontext"]["frozen_graphs"] == 0


def _graph_with_parameter():
    weight = torch.nn.Parameter(torch.randn(3, 4))
    graph = fx.Graph()
    x, w, extra = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("unused_param")
    graph.output(graph.call_function(torch.nn.functional.linear, (x, w)))
    del extra
    return fx.GraphModule(torch.nn.Module(), graph), weight


def test_fold_parameters_turns_used_parameters_into_attributes_and_keeps_the_rest():
    """A used ``nn.Parameter`` input becomes a ``get_attr`` of the same tensor (no copy); a
    plain tensor input and an unused parameter stay inputs; the compiled callable is handed
    only what is left, and the wrapper drops the rest from the original inputs."""
    gm, weight = _graph_with_parameter()
    x, unused = torch.randn(2, 4), torch.nn.Parameter(torch.randn(1))
    inputs, keep = fold_parameters(gm, [x, weight, unused])
    assert keep == [0, 2] and inputs[0] is x and inputs[1] is unused
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(attrs) == 1 and getattr(gm, attrs[0].target) is weight
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x", "unused_param"]
    seen = []

    def compiled(*args):
        seen.append(args)
        return gm(*args)

    out = drop_folded(compiled, keep)(x, weight, unused)
    assert len(seen[0]) == 2
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


def test_fold_parameters_refuses_mismatched_inputs():
    gm, weight = _graph_with_parameter()
    try:
        fold_parameters(gm, [weight])
    except ValueError as err:
        assert "3 inputs but 1 example inputs" in str(err)
    else:
        raise AssertionError("a mismatch must raise")
