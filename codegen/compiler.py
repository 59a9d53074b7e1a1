"""Compile generated sources once and cache them by spec.

``load_kernels(spec)`` writes the generated module to a cache directory (Triton's ``jit``
reads a kernel's source from its file, so the text must live on disk), imports it under a
private module name and returns it. Results are memoised per ``(spec, interpreter mode)``
with ``functools.cache``: the same spec returns the very same ``CompiledKernels`` (hence
the same ``@triton.jit`` objects, whose per-device binaries Triton caches itself).

Cache directory: ``$SPECONTEXT_KERNEL_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/specontext_compile/kernels`` (``~/.cache/...``), else a per-user folder
under the system temp dir. File names carry a hash of the source, so stale files are never
reused and concurrent writers agree (atomic rename).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .generator import generated_source
from .spec import KernelSpec, RetrievalSpec

__all__ = [
    "CompiledKernels",
    "cache_dir",
    "clear_cache",
    "interpreter_enabled",
    "load_kernels",
    "triton_available",
]

logger = logging.getLogger(__name__)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """Whether the generated Triton kernels can run here.

    True when triton imports and either a CUDA device is present (compiled kernels) or
    ``TRITON_INTERPRET=1`` is set (interpreter on CPU tensors). Never raises.
    """
    if not _triton_importable():
        return False
    if interpreter_enabled():
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA setups
        logger.debug("torch.cuda.is_available() failed", exc_info=True)
        return False


def cache_dir() -> Path:
    """Directory holding generated modules (created on demand, see module docstring)."""
    explicit = os.environ.get("SPECONTEXT_KERNEL_CACHE_DIR")
    if explicit:
        candidates = [Path(explicit)]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        candidates = [Path(xdg) / "specontext_compile" / "kernels"]
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    candidates.append(Path(tempfile.gettempdir()) / f"specontext_compile-kernels-{uid}")
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            logger.debug("kernel cache dir %s not usable", path, exc_info=True)
    raise OSError(
        f"no writable kernel cache directory among {candidates}; "
        "set SPECONTEXT_KERNEL_CACHE_DIR to a writable folder"
    )


@dataclass(frozen=True)
class CompiledKernels:
    """A generated module, imported.

    Attributes:
        spec: the spec it was generated for.
        source: the generated text (``generated_source(spec)``).
        path: the file it was imported from.
        module: the imported module (``launch`` plus the ``@triton.jit`` kernels).
        interpreted: whether its kernels were created under ``TRITON_INTERPRET=1``.
    """

    spec: KernelSpec | RetrievalSpec
    source: str
    path: Path
    module: ModuleType
    interpreted: bool

    @property
    def launch(self):
        """The module's ``launch`` function."""
        return self.module.launch


def _write_source(source: str, stem: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{stem}_{digest}.py"
    if path.exists() and path.read_text() == source:
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{stem}", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(source)
    os.replace(tmp, path)
    return path


def _import_file(path: Path) -> ModuleType:
    name = f"specontext_compile.codegen._generated.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:  # pragma: no cover
        raise ImportError(f"cannot import generated kernel module {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@functools.cache
def _load(spec: KernelSpec | RetrievalSpec, interpreted: bool) -> CompiledKernels:
    source = generated_source(spec)
    path = _write_source(source, spec.name)
    module = _import_file(path)
    logger.info("compiled %s from %s (interpreter=%s)", spec.name, path, interpreted)
    return CompiledKernels(
        spec=spec, source=source, path=path, module=module, interpreted=interpreted
    )


def load_kernels(spec: KernelSpec | RetrievalSpec) -> CompiledKernels:
    """Generated kernels for ``spec``, compiled once per spec and interpreter mode.

    Raises:
        ImportError: when triton is not installed.
        TypeError: when ``spec`` is neither a ``KernelSpec`` nor a ``RetrievalSpec``.
    """
    if not isinstance(spec, (KernelSpec, RetrievalSpec)):
        raise TypeError(f"expected a KernelSpec or RetrievalSpec, got {type(spec).__name__}")
    if not _triton_importable():
        raise ImportError(
            "the generated kernels need triton: pip install 'specontext-compile"
            "[triton]' (or use the torch path of specontext_compile.runtime)"
        )
    return _load(spec, interpreter_enabled())


def clear_cache() -> None:
    """Forget the in-process cache (files on disk stay; they are keyed by content)."""
    _load.cache_clear()
