"""Regional compilation (specontext_compile/regional.py): each distinct decoder layer is
compiled once and called for every layer of its kind; the step computes what the whole-graph
compile and the eager op chain compute, and the counters show which path ran."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx
from torch._dynamo.utils import counters

from _tiny import compiled_steps, tiny_llama
from specontext_compile.regional import EPILOGUE, PROLOGUE, compile_regions, region_labels, structure_key
from specontext_compile.runtime.aten_step import record_query

IDS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))


def _decode_graph(layers: int, monkeypatch) -> fx.GraphModule:
    """The last graph the backend handed to regional compilation (the decode graph)."""
    import specontext_compile.backend as backend

    graphs = []

    def spy(gm, *args, **kwargs):
        graphs.append(gm)
        return compile_regions(gm, *args, **kwargs)

    monkeypatch.setattr(backend, "compile_regions", spy)
    compiled_steps(tiny_llama(layers=layers), IDS, 1, budget=8)
    return graphs[-1]


def test_regional_step_equals_the_eager_op_chain_and_shares_layers():
    """4 layers, default options: logits of 4 decode steps equal the eager op chain's (fp32,
    atol 1e-5: the compiled step sums in another order), the same path counters, and the
    regions: prologue, 4 layers, epilogue = 6, of which 4 compiled (prologue; layer 0, which
    also selects; layers 1-3 share one region, their record slots lifted to tensors; epilogue)."""
    model = tiny_llama(layers=4)
    counters.clear()
    regional, cache = compiled_steps(model, IDS, 4, budget=8)
    regions = dict(counters["specontext"])
    eager, eager_cache = compiled_steps(model, IDS, 4, budget=8, inner="eager")
    torch.testing.assert_close(regional, eager, atol=1e-5, rtol=0)
    assert cache.path_counts() == eager_cache.path_counts()
    assert cache.path_counts()["gather_sites"] == 16  # 4 steps x 4 layers, the sparse path
    assert (regions["regions"], regions["regions_compiled"], regions["regions_as_subgraphs"]) == (6, 4, 1)


def test_the_step_is_one_graph_calling_each_distinct_region_as_a_subgraph(monkeypatch):
    """The graph inductor compiles calls ``invoke_subgraph`` once per region (6) on 4 distinct
    subgraphs, and nothing else computes outside them (only the op's item reads): one
    compiled call per step, no Python between regions."""
    import specontext_compile.regional as regional

    stitched = []

    def spy(split, keys):
        stitched.append(real(split, keys))
        return stitched[-1]

    real = regional.stitch_subgraphs
    monkeypatch.setattr(regional, "stitch_subgraphs", spy)
    compiled_steps(tiny_llama(layers=4), IDS, 1, budget=8)
    graph = stitched[-1].graph
    calls = [n for n in graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert (len(calls), len({n.args[0].target for n in calls})) == (6, 4)
    others = [n for n in graph.nodes if n.op == "call_function" and n not in calls]
    assert all(n.target.__name__ == "getitem" for n in others), [n.format_node() for n in others]


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_where_invoke_subgraph_cannot_stitch_the_regions_are_compiled_one_by_one(monkeypatch):
    """torch 2.13's ``invoke_subgraph`` refuses in-place input writes under autograd and
    opaque ops that write an argument: the default decode graph stitches without grad, not
    with it, and a graph keeping our ops (``lower=False``) names its writing op; such graphs
    take the per-region compile (counted: no ``regions_as_subgraphs``) and stay exact."""
    from specontext_compile.regional import subgraph_reason

    gm = _decode_graph(3, monkeypatch)
    with torch.no_grad():
        assert subgraph_reason(gm) is None
    with torch.enable_grad():
        assert subgraph_reason(gm) == "gradients are enabled"
    model = tiny_llama(layers=3)
    counters.clear()
    kept, cache = compiled_steps(model, IDS, 3, budget=8, lower=False)
    assert counters["specontext"]["regions"] > counters["specontext"]["regions_compiled"] > 0
    assert counters["specontext"]["regions_as_subgraphs"] == 0
    eager, eager_cache = compiled_steps(model, IDS, 3, budget=8, inner="eager")
    torch.testing.assert_close(kept, eager, atol=1e-5, rtol=0)
    assert cache.path_counts() == eager_cache.path_counts()
    assert cache.path_counts()["gather_sites"] > 0  # budget 8 < 40 tokens: the sparse gather ran


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_symbolic_recompile_is_regional_and_exact():
    """A second and third prompt with other cache capacities make dynamo recompile the decode
    graph with symbolic sizes; that graph is split and compiled by regions too, and every
    prompt's 4 decode steps equal the eager op chain's (atol 1e-5) with the same counters."""
    import specontext_compile as sc

    model = tiny_llama(layers=3)

    def prompts(forward):
        rows = []
        for length, capacity in ((40, 60), (50, 80), (30, 100)):
            ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
            cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
            out, logits = forward(input_ids=ids, cache=cache, use_cache=True), []
            for _ in range(4):
                out = forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
                logits.append(out.logits[:, -1])
            rows.append((torch.stack(logits, 1), cache.path_counts()))
        return rows

    results = {}
    for inner in ("auto", "eager"):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            results[inner] = prompts(torch.compile(model.forward, backend="specontext",
                                                   options={"budget": 8, "inner": inner}))
        if inner == "auto":
            regions = dict(counters["specontext"])
    assert regions["regions"] == 10  # two decode graphs (static, then symbolic) of 5 regions
    for (regional, counts), (eager, eager_counts) in zip(results["auto"], results["eager"]):
        torch.testing.assert_close(regional, eager, atol=1e-5, rtol=0)
        assert counts == eager_counts and counts["gather_sites"] == 12


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_regional_off_or_frozen_compiles_the_graph_whole():
    """``regional=False``, and ``freezing=True`` (a frozen region would not be shared), compile
    the decode graph whole: no region counted."""
    model = tiny_llama(layers=2)
    for options in ({"regional": False}, {"freezing": True}):
        counters.clear()
        compiled_steps(model, IDS, 1, budget=8, **options)
        assert counters["specontext"]["regions"] == 0, options


def test_labels_follow_the_layers_and_lift_the_record_slots(monkeypatch):
    """Every computing node gets a label; labels appear in graph order as one run each:
    prologue, layers 0..n-1, epilogue; each layer's lagged-query record sits in its layer
    with its slot lifted to a tensor made in the prologue (``torch.full``)."""
    gm = _decode_graph(3, monkeypatch)
    labels = region_labels(gm.graph)
    computing = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert set(labels) == set(computing)
    records = [n for n in computing if n.target is record_query]
    assert len(records) == 3
    for record in records:
        slot = record.args[3]
        assert isinstance(slot, fx.Node) and slot.target is torch.full and labels[slot] == PROLOGUE
        assert labels[record] not in (PROLOGUE, EPILOGUE)
    order = list(labels.values())
    runs = [label for i, label in enumerate(order) if i == 0 or label != order[i - 1]]
    assert runs[0] == PROLOGUE and runs[-1] == EPILOGUE
    layers = runs[1:-1]
    assert len(layers) == 3 and len(set(layers)) == 3
    assert [int(re.search(r"(\d+)\]?$", label).group(1)) for label in layers] == [0, 1, 2]


def _tiny_graph(dtype: torch.dtype, scale: float) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["example_value"] = torch.empty(2, 3, dtype=dtype)
    del mode
    graph.output(graph.call_function(torch.mul, (x, scale)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_structure_key_separates_constants_and_input_metadata():
    """Equal programs share a key whatever the node names; a different constant or input dtype
    gives another key (a region is reused only for the same program)."""
    a, b = _tiny_graph(torch.float32, 2.0), _tiny_graph(torch.float32, 2.0)
    b.graph.find_nodes(op="placeholder")[0].name = "renamed"
    assert structure_key(a) == structure_key(b)
    assert structure_key(a) != structure_key(_tiny_graph(torch.float32, 3.0))
    assert structure_key(a) != structure_key(_tiny_graph(torch.float64, 2.0))


def test_a_graph_without_layers_is_compiled_whole():
    """No decoder layer in the graph: ``compile_regions`` declines (None) without compiling."""
    gm = _tiny_graph(torch.float32, 2.0)
    called = []
    assert compile_regions(gm, lambda graph, inputs: called.append(graph), []) is None
    assert not called


@pytest.mark.slow
def test_regional_step_equals_the_whole_graph_compile():
    """The same 4 steps compiled whole (``regional=False``): logits within 1e-5 (fusion
    boundaries move the rounding), identical path counters."""
    model = tiny_llama(layers=4)
    regional, cache = compiled_steps(model, IDS, 4, budget=8)
    whole, whole_cache = compiled_steps(model, IDS, 4, budget=8, regional=False)
    torch.testing.assert_close(regional, whole, atol=1e-5, rtol=0)
    assert cache.path_counts() == whole_cache.path_counts()
