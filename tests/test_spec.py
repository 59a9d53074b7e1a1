"""The step's typed options (``runtime/spec.py``): validation, value semantics, FX round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx

import specontext_compile as sc
from specontext_compile.runtime import aten_step
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

specs = st.builds(
    lambda budget, extra, sink, recent, cov, rescue, page, shortcut, kernel: StepSpec(
        budget, budget + extra, sink, recent, cov, rescue, page, shortcut, kernel),
    st.integers(1, 4096), st.integers(0, 4096), st.integers(0, 64), st.integers(0, 256),
    st.floats(0.0, 0.99), st.integers(0, 8192), st.sampled_from([0, 8, 16, 32]), st.booleans(),
    st.sampled_from(["auto", "torch", "triton"]))
variants = st.builds(AttentionVariant, st.floats(1e-3, 4.0), st.one_of(st.none(), st.floats(1.0, 100.0)),
                     st.integers(0, 4096))


@settings(max_examples=60, deadline=None)
@given(spec=specs, variant=variants)
def test_fx_repr_rebuilds_an_equal_value_with_an_equal_hash(spec, variant):
    for value in (spec, variant):
        text, names = value.__fx_repr__()
        again = eval(text, dict(names))  # noqa: S307  (our own repr)
        assert again == value and hash(again) == hash(value)


@pytest.mark.parametrize("bad, field", [
    (dict(budget=0, candidate_slots=1), "budget"),
    (dict(budget=8, candidate_slots=4), "candidate_slots"),
    (dict(budget=8, candidate_slots=8, sink_tokens=-1), "sink_tokens"),
    (dict(budget=8, candidate_slots=8, min_coverage=1.0), "min_coverage"),
    (dict(budget=8, candidate_slots=8, kernel="cuda"), "kernel"),
    (dict(budget=8, candidate_slots=8, dense_shortcut=1), "dense_shortcut"),
    (dict(budget=True, candidate_slots=8), "budget"),
])
def test_a_bad_step_spec_names_its_field(bad, field):
    with pytest.raises(ValueError, match=f"StepSpec.{field}"):
        StepSpec(**bad)


@pytest.mark.parametrize("bad, field", [
    (dict(scale=0.0), "scale"), (dict(scale=math.inf), "scale"), (dict(scale=0.1, soft_cap=-2.0), "soft_cap"),
    (dict(scale=0.1, sliding_window=-1), "sliding_window"),
])
def test_a_bad_variant_names_its_field(bad, field):
    with pytest.raises(ValueError, match=f"AttentionVariant.{field}"):
        AttentionVariant(**bad)


def test_the_config_builds_the_spec_and_a_store_sets_its_page_size():
    config = sc.SpeContextConfig(budget=100, candidates=1.5, sink_tokens=2, recent_window=8, min_coverage=0.5)
    spec = StepSpec.from_config(config)
    assert (spec.budget, spec.candidate_slots, spec.sink_tokens, spec.recent_window) == (100, 150, 2, 8)
    assert spec.rescue_tokens == config.page_rescue == 200 and spec.rescue_pages == 0  # no store yet
    assert spec.for_store(16).rescue_pages == 13 and spec.for_store(16).refines
    assert spec.for_store(0).rescue_tokens == 0  # a store without page bounds: no rescue
    assert not StepSpec(8, 8).refines
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.budget = 5


def test_an_op_node_with_specs_prints_and_runs_as_python():
    """FX writes a spec argument back as its constructor (``__fx_repr__``), so the printed
    graph module runs the op exactly as the node does."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    idx = torch.tensor([[[0, 3, 7, -1], [1, 2, 11, 5]]])
    spec, variant = StepSpec(4, 4), AttentionVariant(0.3, 20.0)
    graph = fx.Graph()
    inputs = [graph.placeholder(n) for n in ("q", "k", "v", "idx", "n")]
    out = graph.call_function(torch.ops.specontext.sparse_attention.default, (*inputs, None, spec, variant))
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert "StepSpec(budget=4" in gm.code and "AttentionVariant(scale=0.3" in gm.code
    want = aten_step.sparse_attention(q, k, v, idx, torch.tensor(12), None, spec, variant)
    assert torch.equal(gm(q, k, v, idx, torch.tensor(12)), want)
