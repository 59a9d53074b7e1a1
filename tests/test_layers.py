"""The package's layering (issue 53, item 5): no import cycles among its modules, the core
(passes, runtime, codegen) imports nothing but itself and the options, and ``import
specontext_compile`` loads no server.

Imports are read from the sources (``ast``), function-local ones included: a lazy import
that closes a cycle is still a cycle a reader has to hold in their head. ``from . import x``
of a submodule ``x`` is an import of ``x`` (not of the package's ``__init__``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
CORE = ("specontext_compile.runtime", "specontext_compile.passes", "specontext_compile.codegen")
#: what the core may import outside itself: the validated options
CORE_MAY_IMPORT = {"specontext_compile.config"}


def _layout():
    """scripts/layout_counts.py, which reads the import graph and the ``torch._*`` uses."""
    spec = importlib.util.spec_from_file_location("layout_counts", ROOT / "scripts" / "layout_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _modules() -> dict[str, Path]:
    return _layout().modules(ROOT)


def _graph() -> nx.DiGraph:
    return _layout().import_graph(ROOT)


def test_the_graph_reader_sees_the_package():
    graph = _graph()
    assert graph.number_of_nodes() > 60
    assert graph.has_edge("specontext_compile.backend", "specontext_compile.passes.sparse_rewrite")
    assert graph.has_edge("specontext_compile.backend", "specontext_compile.fallbacks")  # from . import fallbacks


def test_no_import_cycles():
    cycles = _layout().import_cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_imports_only_itself_and_the_options():
    outside = sorted((a, b) for a, b in _graph().edges
                     if a.startswith(CORE) and not b.startswith(CORE) and b not in CORE_MAY_IMPORT)
    assert not outside, outside


def test_importing_the_package_loads_no_server():
    """``import specontext_compile`` loads the compiler: not the server, the serving helpers,
    the CLI or the explain tool (those load on first use of their names: PEP 562)."""
    code = ("import sys, specontext_compile; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'openai')"
            " or m.startswith(('specontext_compile.serve', 'specontext_compile.cli', 'specontext_compile.explain'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_lazy_names_stay_functions_after_their_modules_load():
    """The package's lazy names resolve to their functions, also after their modules were
    imported directly (as the CLI does): the explain tool's module is ``explain_report``, since
    a submodule named ``explain`` would replace the function ``explain`` (found by a review)."""
    import specontext_compile as sc
    import specontext_compile.explain_report
    import specontext_compile.serving
    from specontext_compile import continuous_batching_config, explain

    assert explain is specontext_compile.explain_report.explain and callable(sc.explain)
    assert continuous_batching_config is specontext_compile.serving.continuous_batching_config


def _private_torch_uses(path: Path) -> list[str]:
    return _layout().private_torch_uses(path)


def test_private_torch_apis_are_wrapped_in_one_module():
    """Only ``runtime/torch_private.py`` (every private torch API, with its reason and the torch
    version checked) and ``logs.py`` (torch's logging registry) touch ``torch._*`` in code
    (issue 53, item 2)."""
    allowed = {"specontext_compile.runtime.torch_private", "specontext_compile.logs"}
    touching = {name: uses for name, path in _modules().items()
                if (uses := _private_torch_uses(path)) and name not in allowed}
    assert touching == {}
    assert _private_torch_uses(ROOT / "runtime" / "torch_private.py")  # the scan sees what is there
