"""The package's layout in numbers (issue 53, "Done when"): custom ops, functions kept alive by a
hand-kept table, files whose code touches ``torch._*``, codegen lines, import cycles, README
lines and docs/ files, for this checkout or another one (``--root``, e.g. a ``git worktree``
of an older commit). Everything is read from the sources (``ast`` and regular expressions):
nothing is imported, so an old checkout needs no venv of its own.

    python scripts/layout_counts.py [--root CHECKOUT] [--json FILE]

tests/test_layers.py loads this file for its import graph and its ``torch._*`` scan.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
#: an op of ours defined by any of torch.library's three spellings
_OP = re.compile(r"""(?:custom_op|triton_op|library\.define)\(\s*["']specontext::(\w+)""")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed packages, by dotted name (pyproject's ``package-dir``)."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for package, folder in setup["package-dir"].items():
        for path in (root / folder).glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (file ``path``) imports, anywhere in the file
    (function-local imports too). ``from . import x`` of a submodule ``x`` imports ``x``."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            submodules = {f"{module}.{alias.name}" for alias in node.names} & known.keys()
            found |= submodules
            if len(submodules) < len(node.names):  # a name from the module itself
                found.add(module)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    """Module -> the package modules it imports."""
    known = modules(root)
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        graph.add_edges_from((name, target) for target in imported(name, path, known))
    return graph


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds at least one cycle)."""
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def private_torch_uses(path: Path) -> list[str]:
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


def _hand_kept(paths: list[Path]) -> int:
    """Names in a module-level ``MUTATES`` table (the step functions dead-code elimination was
    told by hand to keep)."""
    count = 0
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MUTATES" for t in node.targets)
                    and isinstance(node.value, (ast.Dict, ast.Set, ast.Tuple, ast.List))):
                count += len(node.value.keys) if isinstance(node.value, ast.Dict) else len(node.value.elts)
    return count


def counts(root: Path = ROOT) -> dict:
    """The layout's numbers for the checkout at ``root``."""
    known = modules(root)
    package = {n: p for n, p in known.items() if n.startswith("specontext_compile")}
    text = {n: p.read_text() for n, p in package.items()}
    graph = import_graph(root)
    docs = root / "docs"
    return {
        "custom_ops": sorted({m for t in text.values() for m in _OP.findall(t)}),
        "hand_kept_mutators": _hand_kept(list(package.values())),
        "has_side_effect_registrations": sum(len(re.findall(r"^@has_side_effect", t, re.M)) for t in text.values()),
        "own_dead_code_predicates": sum(t.count("is_impure_node=") for t in text.values()),
        "files_touching_torch_private": sorted(n for n, p in package.items() if private_torch_uses(p)),
        "codegen_lines": sum(len(p.read_text().splitlines()) for p in sorted((root / "codegen").glob("*.py"))),
        "import_cycles": import_cycles(graph),
        "package_modules": len(package),
        "readme_lines": len((root / "README.md").read_text().splitlines()),
        "docs_top_level_files": sum(1 for p in docs.iterdir() if p.is_file()),
        "docs_files": sum(1 for p in docs.rglob("*") if p.is_file()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    found = counts(args.root.resolve())
    text = json.dumps(found, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)  # noqa: T201 - a script's output


if __name__ == "__main__":
    main()
