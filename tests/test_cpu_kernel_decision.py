"""Which of our C++ CPU kernels a site runs is decided once, by the pass, and stored on its spec
(issue 53, item 1: one decision).

The pass asks :func:`routes.cpu_kernel` / :func:`routes.selection_kernel` (which ask the kernels'
``applies``) once per site and once per selection node, and writes the answer as
``StepSpec.cpu_kernel``; the traced bodies read that flag and ask nothing. Checked on a tiny
Llama compiled by the real backend: the rewritten graph's specs, the number of ``applies``
calls (one per site, none while inductor traces the step), the kernel counters of the steps
that ran, and negatives (an eager step, ``lower=False``, a refusal at the pass) where no kernel
may run.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_llama
from specontext_compile.backend import clear_compile_reports
from specontext_compile.runtime import cpu_kernels, cpu_refine, cpu_selection, routes, scorers
from specontext_compile.runtime.spec import StepSpec

import specontext_compile as sc


_DEFAULT = {"budget": 8, "page_rescue": 16}  # refined sites with the page rescue, as the default
_KERNEL_CALLS = ("cpu_kernel_refine_calls", "cpu_kernel_selection_calls", "cpu_kernel_attention_calls")


def _decode_specs() -> tuple[list[StepSpec], list[StepSpec]]:
    """The specs the pass wrote into the last decode graph: (its attention and refinement
    sites', its selection nodes')."""
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"][-1]
    sites, selections = [], []
    for node in decode.graph_module.graph.nodes:
        specs = [a for a in node.args if isinstance(a, StepSpec)]
        (selections if node.target is scorers.head_select else sites).extend(specs)
    return sites, selections


def _run(model, steps: int = 3, **options) -> dict[str, int]:
    """Compile, prefill 30 tokens, decode ``steps``; the kernel counters' increments."""
    torch._dynamo.reset()
    clear_compile_reports()
    before = cpu_kernels.kernel_calls()  # the Python and the C++ operator kernels' calls
    forward = torch.compile(model.forward, backend="specontext", options=options)
    cache = sc.SpeContextCache(model.config, max_cache_len=48)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = forward(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(steps):
            out = forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    after = cpu_kernels.kernel_calls()
    return {n: after[n] - before[n] for n in _KERNEL_CALLS}


def _counting(monkeypatch, module, calls: list):
    real = module.applies

    def counted(*args, **kwargs):
        calls.append(module.__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "applies", counted)


@pytest.mark.skipif(not (cpu_refine.available() and cpu_selection.available()), reason="CPU kernels do not build here")
def test_the_pass_decides_each_site_once_and_the_step_reads_it(monkeypatch):
    model = tiny_llama()
    layers = model.config.num_hidden_layers
    calls: list[str] = []
    for module in (cpu_refine, cpu_selection, cpu_kernels):
        _counting(monkeypatch, module, calls)
    ran = _run(model, **_DEFAULT)
    sites, selections = _decode_specs()
    assert sites and all(s.compiled and s.cpu_kernel for s in sites)  # refinement and attention: one spec
    assert selections and all(s.cpu_kernel for s in selections)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"][-1]
    assert decode.result.cpu_kernel_sites == layers
    # one question per site and one per selection node, all at the pass; none while tracing
    assert sorted(calls) == sorted([cpu_refine.__name__] * layers + [cpu_selection.__name__])
    assert ran == {"cpu_kernel_refine_calls": 3 * layers, "cpu_kernel_selection_calls": 3,
                   "cpu_kernel_attention_calls": 0}


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels do not build here")
def test_the_dense_route_takes_the_dense_kernel_by_the_pass_decision():
    model = tiny_llama()
    ran = _run(model, budget=4096)  # the budget covers the store: every site dense over it
    sites, _ = _decode_specs()
    assert sites and all(s.route == "dense" and s.cpu_kernel for s in sites)
    assert ran["cpu_kernel_attention_calls"] == 3 * model.config.num_hidden_layers
    assert ran["cpu_kernel_refine_calls"] == 0


@pytest.mark.parametrize("options", [{"inner": "eager"}, {"lower": False}], ids=["eager", "ops"])
def test_no_kernel_where_the_step_is_not_compiled_by_inductor(options, monkeypatch):
    """An eager step (or the opaque ops) keeps the torch bodies: the reference the kernels are
    checked against. The pass does not even ask the kernels."""
    calls: list[str] = []
    for module in (cpu_refine, cpu_selection, cpu_kernels):
        _counting(monkeypatch, module, calls)
    ran = _run(tiny_llama(), **_DEFAULT, **options)
    sites, selections = _decode_specs()
    assert sites and not any(s.compiled or s.cpu_kernel for s in sites + selections)
    assert calls == [] and set(ran.values()) == {0}


def test_a_refusal_at_the_pass_keeps_the_torch_bodies(monkeypatch):
    """The kernels refuse (as for a site they cannot serve): the flag stays False and the
    compiled step runs inductor's bodies, no kernel call."""
    monkeypatch.setattr(routes, "cpu_kernel", lambda *a, **k: False)
    monkeypatch.setattr(routes, "selection_kernel", lambda *a, **k: False)
    ran = _run(tiny_llama(), **_DEFAULT)
    sites, selections = _decode_specs()
    assert sites and not any(s.cpu_kernel for s in sites + selections)
    assert set(ran.values()) == {0}


def _batches(forward, model, batches) -> list[dict[str, int]]:
    """Decode 2 steps at each batch size of ``batches`` (a fresh cache each) with one compiled
    ``forward``; the kernel counters' increments per batch size."""
    counts = []
    for b in batches:
        cache = sc.SpeContextCache(model.config, max_cache_len=48)
        before = cpu_kernels.kernel_calls()
        with torch.no_grad():
            out = forward(input_ids=torch.randint(0, 128, (b, 30)), cache=cache, use_cache=True)
            for _ in range(2):
                out = forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        after = cpu_kernels.kernel_calls()
        counts.append({n: after[n] - before[n] for n in _KERNEL_CALLS})
    return counts


@pytest.mark.skipif(not (cpu_refine.available() and cpu_selection.available()), reason="CPU kernels do not build here")
def test_a_second_batch_size_keeps_the_kernels_only_with_static_shapes(caplog):
    """A second batch size makes dynamo's sizes symbolic, and our kernels need static ones: the
    step then runs its torch bodies (no kernel call), said at INFO with the fix; compiled with
    ``dynamic=False`` each batch size gets its own graph and keeps every kernel."""
    model = tiny_llama()
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="specontext_compile.runtime.routes"):
        dynamic = _batches(torch.compile(model.forward, backend="specontext", options=_DEFAULT), model, (2, 3))
    assert dynamic[0]["cpu_kernel_selection_calls"] == 2 and dynamic[0]["cpu_kernel_refine_calls"] > 0, dynamic
    assert not any(dynamic[1].values()), dynamic  # the symbolic graph: torch bodies only
    assert "dynamic=False" in caplog.text
    torch._dynamo.reset()
    static = _batches(torch.compile(model.forward, backend="specontext", options=_DEFAULT, dynamic=False), model, (2, 3))
    assert all(c["cpu_kernel_selection_calls"] == 2 and c["cpu_kernel_refine_calls"] > 0 for c in static), static
