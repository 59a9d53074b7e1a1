"""The package's layering (issue 53, item 5): no import cycles among its modules, the core
(passes, runtime, codegen) imports nothing but itself and the options, and ``import
specontext_compile`` loads no server.

Imports are read from the sources (``ast``), function-local ones included: a lazy import
that closes a cycle is still a cycle a reader has to hold in their head. ``from . import x``
of a submodule ``x`` is an import of ``x`` (not of the package's ``__init__``)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
CORE = ("specontext_compile.runtime", "specontext_compile.passes", "specontext_compile.codegen")
#: what the core may import outside itself: the validated options
CORE_MAY_IMPORT = {"specontext_compile.config"}


def _modules() -> dict[str, Path]:
    """Every module of the installed packages, by dotted name (pyproject's ``package-dir``)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package, folder in setup["package-dir"].items():
        for path in (ROOT / folder).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (file ``path``) imports, anywhere in the file."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            submodules = {f"{module}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules
            if len(submodules) < len(node.names):  # a name from the module itself
                found.add(module)
    return {m for m in found if m in modules and m != name}


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in _imported(name, path, modules))
    return graph


def test_the_graph_reader_sees_the_package():
    graph = _graph()
    assert graph.number_of_nodes() > 60
    assert graph.has_edge("specontext_compile.backend", "specontext_compile.passes.sparse_rewrite")
    assert graph.has_edge("specontext_compile.backend", "specontext_compile.fallbacks")  # from . import fallbacks


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
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
    """``torch._*`` names a module's code touches (imports and attribute chains; strings and
    comments do not count)."""
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


def test_private_torch_apis_are_wrapped_in_one_module():
    """Only ``runtime/torch_private.py`` (every private torch API, with its reason and the torch
    version checked) and ``logs.py`` (torch's logging registry) touch ``torch._*`` in code
    (issue 53, item 2)."""
    allowed = {"specontext_compile.runtime.torch_private", "specontext_compile.logs"}
    touching = {name: uses for name, path in _modules().items()
                if (uses := _private_torch_uses(path)) and name not in allowed}
    assert touching == {}
    assert _private_torch_uses(ROOT / "runtime" / "torch_private.py")  # the scan sees what is there
