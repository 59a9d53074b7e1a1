"""Functions in runtime/ and passes/ with more parameters than a limit (issue 27: at most 8).

    python scripts/signature_widths.py [--limit 8]

Counts positional, keyword-only and ``*args``/``**kwargs`` parameters of every function and
method (``self``/``cls`` not counted), widest first; exits 0 (a report, not a check)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def widths(folders=("runtime", "passes")) -> list[tuple[int, str]]:
    """``(parameters, "file:line name")`` of every function in ``folders``."""
    rows = []
    for folder in folders:
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if a.args and a.args[0].arg in ("self", "cls"):
                    count -= 1
                rows.append((count, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8)
    limit = parser.parse_args().limit
    over = [(n, where) for n, where in widths() if n > limit]
    for n, where in over:
        print(f"{n:3d}  {where}")
    print(f"{len(over)} functions over {limit} parameters")


if __name__ == "__main__":
    main()
