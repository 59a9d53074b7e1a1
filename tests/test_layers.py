"""The package's layers (issue 53, item 5): no import cycle, a core (passes, runtime, codegen)
that imports no tool, and ``import specontext_compile`` that loads the compiler only. The
graph is read from the sources by ``scripts/import_graph.py`` (no import)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("lazy", [False, True], ids=["at-import", "with-imports-inside-functions"])
def test_the_package_has_no_import_cycle(import_graph, lazy):
    g = import_graph.graph(lazy=lazy)
    assert g.number_of_nodes() > 50  # the whole package was read (passes, runtime, codegen, tools)
    assert import_graph.cycles(g) == []


def test_the_core_imports_no_tool(import_graph):
    g = import_graph.graph(lazy=True)
    assert import_graph.core_imports_of_tools(g) == []


def test_the_graph_finds_a_cycle_and_a_core_import_of_a_tool(import_graph, tmp_path, monkeypatch):
    """The checks above can fail: two modules importing each other are a cycle, and a runtime
    module importing the server is a core import of a tool."""
    top, runtime = tmp_path / "top", tmp_path / "runtime"
    top.mkdir(), runtime.mkdir()
    (top / "__init__.py").write_text("")
    (top / "serve.py").write_text("from .runtime import step\n")
    (runtime / "__init__.py").write_text("")
    (runtime / "step.py").write_text("import logging\n\ndef run():\n    from ..serve import x\n")
    monkeypatch.setattr(import_graph, "PACKAGE_DIRS", {"specontext_compile": top,
                                                      "specontext_compile.runtime": runtime})
    assert import_graph.cycles(import_graph.graph()) == []  # the runtime's import is inside a function
    lazy = import_graph.graph(lazy=True)
    assert import_graph.cycles(lazy) == [["specontext_compile.runtime.step", "specontext_compile.serve"]]
    assert import_graph.core_imports_of_tools(lazy) == [("specontext_compile.runtime.step", "specontext_compile.serve")]


def test_importing_the_package_loads_no_server_and_no_tool():
    """A fresh interpreter: ``import specontext_compile`` loads the compiler, not the serving
    helpers, the server, the CLI or the explain tool; those load on first use."""
    code = ("import sys, specontext_compile as s\n"
            "tools = sorted(m for m in sys.modules if m.startswith('specontext_compile.') and\n"
            "               m.rsplit('.', 1)[-1].startswith(('serv', 'explain', 'cli')))\n"
            "print(tools)\n"
            "print(callable(s.explain), callable(s.continuous_batching_config))\n"
            "print('specontext_compile.serving' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split("\n")[:3] == ["[]", "True True", "True"], out.stdout + out.stderr


def _private_torch_uses(path: Path) -> list[str]:
    """``torch._*`` names a module's code touches (imports and attribute chains; strings and
    comments do not count)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch._")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
              and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"torch.{node.attr}")
    return found


def test_private_torch_apis_are_wrapped_in_one_module(import_graph):
    """Only ``runtime/torch_private.py`` (every private torch API, with its reason and the torch
    version checked) and ``logs.py`` (torch's logging registry) touch ``torch._*`` in code
    (issue 53, item 2)."""
    allowed = {"specontext_compile.runtime.torch_private", "specontext_compile.logs"}
    touching = {module: uses for module, path in import_graph.modules().items()
                if (uses := _private_torch_uses(path)) and module not in allowed}
    assert touching == {}
    assert _private_torch_uses(ROOT / "runtime" / "torch_private.py")  # the scan sees what is there


def test_the_lazy_names_stay_functions_after_their_modules_load():
    """Importing a tool's module directly (as the CLI does) must not replace the package's
    function of the same purpose by the module (the explain tool's module is ``explain_report``:
    a module named ``explain`` would shadow the function ``explain``; found by a review)."""
    import specontext_compile as sc
    import specontext_compile.explain_report
    import specontext_compile.serving
    from specontext_compile import continuous_batching_config, explain

    assert explain is specontext_compile.explain_report.explain and callable(sc.explain)
    assert continuous_batching_config is specontext_compile.serving.continuous_batching_config
