"""Does another torch have every torch name our code reaches? (issue 55, item 1)

The lent GPU machines run torch 2.11, CI and this repo's venv torch 2.13: an API that moved
between them must not first be found on a device. This script reads our sources (the package,
the device's benchmarks and tests), collects every torch name they reach — ``import torch.x``,
``from torch.x import y``, attribute chains ``torch.a.b.c`` and chains through a name bound to
a torch module (``from torch._inductor import config``; ``config.triton.cudagraph_trees``) —
and resolves each against a torch *source tree* without importing it: modules by file, names
by their module-level definitions (def, class, assignment, import, also under ``if``/``try``),
one level into a class body. A name behind a star import or a module ``__getattr__`` it
cannot see is reported as unresolved, not missing.

Any torch wheel has the sources: a wheel for another platform is fine (its Python files are the
same), e.g. the 80 MB macOS one instead of the CUDA build:

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform macosx_11_0_arm64 torch==2.11.0 -d /tmp/t211
    python scripts/torch_api_check.py /tmp/t211/torch-2.11.0-*.whl      # or a folder holding torch/
    python scripts/torch_api_check.py                                      # the installed torch

Prints one line per name that is missing (and, with ``-v``, each unresolved or found one);
exits 1 when any is missing, 2 on a bad argument (a path that is no torch, a source that does
not exist or does not parse).
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what runs on a device: the package (its folders), the device's benchmarks and tests
SOURCES = ("specontext_compile", "passes", "codegen", "runtime", "benchmarks/gpu_end_to_end.py",
           "benchmarks/gpu_kernels.py", "tests/test_cuda.py", "tests/test_kernel_step.py",
           "tests/test_elastic.py", "tests/test_codegen_attention.py", "tests/test_codegen_offsets.py")


class UsageError(Exception):
    """A bad argument (exit status 2, the message names the fix)."""


class TorchTree:
    """The Python files of one torch, from a wheel or a folder holding ``torch/``."""

    def __init__(self, where: Path):
        if not where.exists():
            raise UsageError(f"{where} does not exist: give a torch wheel or a folder holding torch/")
        if where.is_file():
            if not zipfile.is_zipfile(where):
                raise UsageError(f"{where} is not a wheel (zip) nor a folder holding torch/")
            with zipfile.ZipFile(where) as wheel:
                self.files = {n: wheel.read(n).decode("utf-8", "replace")
                              for n in wheel.namelist() if n.startswith("torch/") and n.endswith((".py", ".pyi"))}
        else:
            base = where if (where / "__init__.py").exists() and where.name == "torch" else where / "torch"
            self.files = {f"torch/{p.relative_to(base).as_posix()}": p.read_text("utf-8", "replace")
                          for p in base.rglob("*.py*") if p.suffix in (".py", ".pyi")}
        if "torch/__init__.py" not in self.files:
            raise UsageError(f"{where}: no torch/__init__.py in it (give a torch wheel or a folder holding torch/)")
        self._names: dict[str, Scope] = {}

    def module_file(self, dotted: str) -> str | None:
        """``torch/a/b.py`` or ``torch/a/b/__init__.py`` for ``torch.a.b``, else None."""
        stem = dotted.replace(".", "/")
        for name in (f"{stem}.py", f"{stem}/__init__.py", f"{stem}.pyi", f"{stem}/__init__.pyi"):  # .pyi: torch._C
            if name in self.files:
                return name
        return None

    def scope(self, dotted: str) -> Scope:
        """The module-level names of module ``dotted`` (which must exist)."""
        if dotted not in self._names:
            file = self.module_file(dotted)
            package = dotted if "/__init__.py" in file else dotted.rpartition(".")[0]
            self._names[dotted] = Scope.of(ast.parse(self.files[file]).body, package)
        return self._names[dotted]


@dataclass
class Scope:
    """Names a module (or class) body defines; ``imports`` maps a bound name to the module or
    ``module.name`` it was imported from; ``classes`` holds one level of class bodies."""

    names: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)
    classes: dict[str, Scope] = field(default_factory=dict)
    star: list[str] = field(default_factory=list)
    dynamic: bool = False  # a module-level __getattr__
    config: bool = False  # a torch config module (install_config_module): its assignments are all it has

    @classmethod
    def of(cls, body: list[ast.stmt], package: str, depth: int = 0) -> Scope:
        """The names ``body`` defines; ``package``: the package relative imports start from."""
        scope = cls()
        for node in body:
            scope._add(node, package, depth)
        return scope

    def _add(self, node: ast.stmt, module: str, depth: int) -> None:  # module: the package
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.names.add(node.name)
            self.dynamic |= node.name == "__getattr__"
        elif isinstance(node, ast.ClassDef):
            self.names.add(node.name)
            if depth == 0:
                self.classes[node.name] = Scope.of(node.body, module, depth + 1)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                self.names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            self.config |= getattr(func, "id", getattr(func, "attr", None)) == "install_config_module"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                self.names.add(bound)
                self.imports[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module)
            for alias in node.names:
                if alias.name == "*":
                    self.star.append(source)
                    continue
                self.names.add(alias.asname or alias.name)
                self.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
        else:  # if / try / with at this level define names too
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._add(child, module, depth)
            for handler in getattr(node, "handlers", []):
                for child in handler.body:
                    self._add(child, module, depth)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def resolve(tree: TorchTree, dotted: str, seen: frozenset = frozenset()) -> str:
    """``"found"``, ``"missing: <why>"`` or ``"unresolved: <why>"`` for ``torch.a.b.c``."""
    parts = dotted.split(".")
    module = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        child = f"{module}.{part}"
        if tree.module_file(child):  # a submodule
            module = child
            continue
        return _in_module(tree, module, parts[i:], seen)
    return "found"


def _in_module(tree: TorchTree, module: str, rest: list[str], seen: frozenset) -> str:
    key = (module, rest[0])
    if key in seen:
        return "unresolved: import cycle"
    scope = tree.scope(module)
    name = rest[0]
    if name in scope.imports and scope.imports[name].startswith("torch"):
        target = scope.imports[name]
        return resolve(tree, ".".join([target, *rest[1:]]), seen | {key})
    if name in scope.names:
        if len(rest) > 1 and name in scope.classes:
            inner = scope.classes[name]
            if rest[1] in inner.names or inner.dynamic:
                return "found"
            return f"unresolved: {rest[1]!r} not in class {module}.{name}'s body (inherited?)"
        return "found"
    for star in scope.star:
        if (star.startswith("torch") and tree.module_file(star)
                and resolve(tree, ".".join([star, *rest]), seen | {key}) == "found"):
            return "found"
    if (scope.star or scope.dynamic) and not scope.config:
        return f"unresolved: {module} has a star import or __getattr__"
    return f"missing: {module} defines no {name!r}"


def references(path: Path) -> set[str]:
    """Every dotted torch name the file at ``path`` reaches (imports and attribute chains)."""
    try:
        tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} cannot be read as Python source: {err}") from None
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # not a chain's end
    bound: dict[str, str] = {"torch": "torch"}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    found.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if alias.name != "*":
                    found.add(f"{node.module}.{alias.name}")
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    shadowed = _rebound_in_functions(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in bound and id(node) not in shadowed.get(chain[0], set()):
                found.add(".".join([bound[chain[0]], *chain[1:]]))
    return {name for name in found if not name.startswith("torch.ops.")}


def _rebound_in_functions(tree: ast.Module) -> dict[str, set[int]]:
    """name -> ids of the attribute nodes inside functions whose parameters or assignments
    rebind that name (there the name is not the module-level import)."""
    out: dict[str, set[int]] = {}
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = func.args
        names = {arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if arg}
        names |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        attrs = {id(n) for n in ast.walk(func) if isinstance(n, ast.Attribute)}
        for name in names:
            out.setdefault(name, set()).update(attrs)
    return out


def _chain(node: ast.Attribute) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def source_files(sources, base: Path = ROOT) -> list[Path]:
    """The ``.py`` files of ``sources`` (files or folders, relative to ``base``).

    Raises:
        UsageError: a source that does not exist, or one that holds no Python file."""
    files = []
    for item in sources:
        path = base / item
        if not path.exists():
            raise UsageError(f"source {path} does not exist")
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        if not found:
            raise UsageError(f"source {path} holds no .py file")
        files.extend(found)
    return files


def check(tree: TorchTree, sources=SOURCES, base: Path = ROOT) -> dict[str, tuple[str, list[str]]]:
    """``{name: (verdict, [files that reach it])}`` for every torch name in ``sources``
    (relative to ``base``)."""
    where: dict[str, list[str]] = {}
    for path in source_files(sources, base):
        for name in references(path):
            where.setdefault(name, []).append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    return {name: (resolve(tree, name), files) for name, files in sorted(where.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("torch", nargs="?", type=Path,
                        help="a torch wheel or a folder holding torch/ (default: the installed torch)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print found and unresolved names")
    parser.add_argument("--sources", nargs="+", default=None,
                        help="files or folders to read, relative to the current folder (default: the package, "
                             "the device benchmarks and tests)")
    args = parser.parse_args(argv)
    if args.torch is None:
        import torch
        args.torch = Path(torch.__file__).parent
    try:
        tree = TorchTree(args.torch)
        results = check(tree, args.sources or SOURCES, ROOT if args.sources is None else Path.cwd())
    except UsageError as err:
        print(f"torch_api_check: {err}", file=sys.stderr)
        return 2
    missing = 0
    for name, (verdict, files) in results.items():
        missing += verdict.startswith("missing")
        if args.verbose or verdict.startswith("missing"):
            print(f"{verdict.split(':')[0]:10} {name}  ({verdict.partition(': ')[2] or 'ok'}; {', '.join(files[:3])})")
    unresolved = sum(v.startswith("unresolved") for v, _ in results.values())
    print(f"{len(results)} torch names reached; {missing} missing, {unresolved} unresolved in {args.torch}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
