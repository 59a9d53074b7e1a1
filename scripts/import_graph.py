"""The package's import-time module graph, read from the sources (no import): which module
imports which at module level (statements run on import, ``if TYPE_CHECKING:`` blocks left
out; imports inside functions are lazy and not edges), its cycles, and what the core imports.

    python scripts/import_graph.py            # the cycles and the core's imports of tools
    python scripts/import_graph.py --edges    # every edge
    python scripts/import_graph.py --lazy     # the imports inside functions count too

``tests/test_layers.py`` holds the package to: no cycle, and a core (passes, runtime, codegen)
that imports nothing from serving, the CLI or the explain tool (issue 53, item 5).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
# where each package's sources are (pyproject.toml's package-dir)
PACKAGE_DIRS = {
    "specontext_compile": ROOT / "specontext_compile",
    "specontext_compile.passes": ROOT / "passes",
    "specontext_compile.codegen": ROOT / "codegen",
    "specontext_compile.runtime": ROOT / "runtime",
    "specontext_compile.runtime.heads": ROOT / "runtime" / "heads",
}
CORE = ("specontext_compile.passes", "specontext_compile.runtime", "specontext_compile.codegen")


def modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module):
    """Import statements run when the module is imported (module level, in ``try`` and
    ``if`` blocks other than ``if TYPE_CHECKING:``)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _targets(module: str, is_package: bool, node, known: set[str]) -> set[str]:
    """The package's modules an import statement loads (a package's ``__init__`` included)."""
    names = set()
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = {prefix} | {f"{prefix}.{alias.name}" for alias in node.names}
    loaded = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            if ".".join(parts[:i]) in known:
                loaded.add(".".join(parts[:i]))
    return loaded


def _all_imports(tree: ast.Module):
    """Every import statement of the module, inside functions too (but not under ``if
    TYPE_CHECKING:``)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
            for n in ast.walk(node)}
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip)


def graph(lazy: bool = False) -> nx.DiGraph:
    """The import-time graph: an edge ``a -> b`` when importing ``a`` runs an import of ``b``
    (a module's own package excluded: Python has already started importing it); ``lazy``: the
    imports inside functions too (what a module needs at all, not only at import)."""
    found = modules()
    known = set(found)
    g = nx.DiGraph()
    g.add_nodes_from(known)
    for module, path in found.items():
        is_package = path.stem == "__init__"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (_all_imports(tree) if lazy else _top_level_imports(tree)):
            for target in _targets(module, is_package, node, known):
                if target != module and not module.startswith(target + "."):
                    g.add_edge(module, target)
    return g


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds a cycle)."""
    return sorted((sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1), key=len, reverse=True)


def core_imports_of_tools(g: nx.DiGraph) -> list[tuple[str, str]]:
    """Edges from the core (passes, runtime, codegen) to anything outside it but the package's
    config, spec and logging modules... i.e. to the server, CLI, explain and the other tools."""
    allowed = {"specontext_compile", "specontext_compile.config", "specontext_compile.logs"}
    return sorted((a, b) for a, b in g.edges if a.startswith(CORE) and not b.startswith(CORE) and b not in allowed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true")
    parser.add_argument("--lazy", action="store_true", help="count the imports inside functions too")
    args = parser.parse_args(argv)
    g = graph(lazy=args.lazy)
    if args.edges:
        for a, b in sorted(g.edges):
            print(f"{a} -> {b}")
    found = cycles(g)
    print(f"{g.number_of_nodes()} modules, {g.number_of_edges()} import-time edges, {len(found)} cycles")
    for component in found:
        print(f"  cycle among {len(component)}: {', '.join(m.removeprefix('specontext_compile.') for m in component)}")
    for a, b in core_imports_of_tools(g):
        print(f"  core imports a tool: {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
