"""Functions in runtime/ and passes/ with more parameters than a limit (issue 27: at most 8),
and the step's other counts that issue quotes (docs/step_core.md).

    python scripts/signature_widths.py [--limit 8] [--root CHECKOUT] [--takes sliding_window] [--counts]

Counts positional, keyword-only and ``*args``/``**kwargs`` parameters of every function and
method (``self``/``cls`` not counted), widest first. ``--root``: another checkout (e.g. a
``git worktree`` of an older commit). ``--takes NAME``: also the functions of the package's
folders (runtime, passes, codegen, specontext_compile) with a parameter ``NAME``.
``--counts``: also the ``specontext::`` ops registered, the ``refine_selection*`` definitions
and the package's lines and modules. Exits 0 (a report, not a check)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

PACKAGE = ("runtime", "passes", "codegen", "specontext_compile")


def _functions(root: Path, folders):
    """``(path, node)`` of every function and method in ``folders`` (their subfolders too)."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path, node


def widths(root: Path, folders=("runtime", "passes")) -> list[tuple[int, str]]:
    """``(parameters, "file:line name")`` of every function in ``folders``."""
    rows = []
    for path, node in _functions(root, folders):
        a = node.args
        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
        if a.args and a.args[0].arg in ("self", "cls"):
            count -= 1
        rows.append((count, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)


def taking(root: Path, name: str) -> list[str]:
    """``"file:line function"`` of every package function with a parameter ``name``."""
    return [f"{path.relative_to(root)}:{node.lineno} {node.name}" for path, node in _functions(root, PACKAGE)
            if name in [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]]


def counts(root: Path) -> dict[str, int]:
    """Custom ops registered (``custom_op``/``triton_op("specontext::``), ``refine_selection*``
    definitions, and the package's lines and modules."""
    files = [p for folder in PACKAGE for p in sorted((root / folder).rglob("*.py"))]
    text = [p.read_text() for p in files]
    ops = sum(len(re.findall(r'(?:custom_op|triton_op)\(\s*"specontext::', t)) for t in text)
    refine = sum(node.name.startswith("refine_selection") for _, node in _functions(root, PACKAGE))
    return {"custom_ops": ops, "refine_selection_definitions": refine,
            "package_lines": sum(t.count("\n") for t in text), "package_modules": len(files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--takes", default=None, metavar="NAME")
    parser.add_argument("--counts", action="store_true")
    args = parser.parse_args()
    over = [(n, where) for n, where in widths(args.root) if n > args.limit]
    for n, where in over:
        print(f"{n:3d}  {where}")
    print(f"{len(over)} functions over {args.limit} parameters")
    if args.takes:
        found = taking(args.root, args.takes)
        files = {where.split(":")[0] for where in found}
        print(f"{len(found)} functions in {len(files)} files take {args.takes}")
    if args.counts:
        for key, value in counts(args.root).items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
