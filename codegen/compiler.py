"""Compile generated sources once and cache them by spec.

``load_kernels(spec)`` writes the generated module to a cache directory (Triton's ``jit``
reads a kernel's source through ``inspect``, so the module has a real file name), imports it
under a private module name and returns it. Results are memoised per ``(spec, interpreter
mode)`` with ``functools.cache``: the same spec returns the very same ``CompiledKernels``
(hence the same ``@triton.jit`` objects, whose per-device binaries Triton caches itself).

Cache directory: ``$SPECONTEXT_KERNEL_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/specontext_compile/kernels`` (``~/.cache/...``), else a per-user folder
under the system temp dir. File names carry a hash of the source, so stale files are never
reused and concurrent writers agree (atomic rename).

Trust: a folder is used only if it is owned by this user and neither group- nor
world-writable (new folders are made ``0o700``); a refused folder is named in a warning with
the reason, and the process then uses a private ``tempfile.mkdtemp()`` folder instead. What
runs is the source this process generated, never what is on disk: the module is compiled from
the text held in memory, and ``linecache`` is primed with that same text so Triton's
``inspect.getsourcelines`` sees it too (a file swapped after the write is never read).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import linecache
import logging
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .generator import generated_source
from .spec import KernelSpec

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


_PRIVATE_DIR: Path | None = None  # this process's mkdtemp fallback, made on first need
_REFUSED: set[tuple[str, str]] = set()  # (folder, reason) already warned about
_LOCK = threading.Lock()


def _untrusted_reason(path: Path) -> str | None:
    """Why ``path`` must not hold code we import (None: it may).

    Refused: not a folder, owned by another user, or writable by group or others (anyone
    who can write there could swap a generated module for their own code). Skipped where the
    platform has no uids (Windows)."""
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows: no POSIX owner / mode bits
        return None
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    uid = os.getuid()
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[info.st_mode & 0o022]
        return f"it is writable by {who} (mode {stat.S_IMODE(info.st_mode):#o}; chmod go-w it)"
    return None


def _private_dir() -> Path:
    """A folder only this process uses (``mkdtemp``: mode 0o700), removed at exit."""
    global _PRIVATE_DIR
    if _PRIVATE_DIR is None or not _PRIVATE_DIR.is_dir():
        _PRIVATE_DIR = Path(tempfile.mkdtemp(prefix="specontext_compile-kernels-"))
        atexit.register(shutil.rmtree, _PRIVATE_DIR, ignore_errors=True)
        logger.info("kernel cache: private folder %s for this process", _PRIVATE_DIR)
    return _PRIVATE_DIR


def cache_dir() -> Path:
    """Directory holding generated modules (created on demand, see module docstring).

    The first usable candidate that passes the trust check (owned by this user, not group- or
    world-writable) wins; a refused one is logged as a warning with its reason and, when none
    is left, a private ``mkdtemp`` folder is used for the rest of the process. An explicit
    ``$SPECONTEXT_KERNEL_CACHE_DIR`` is the only candidate besides that private folder.
    """
    explicit = os.environ.get("SPECONTEXT_KERNEL_CACHE_DIR")
    if explicit:
        candidates = [Path(explicit)]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        candidates = [Path(xdg) / "specontext_compile" / "kernels",
                      Path(tempfile.gettempdir()) / f"specontext_compile-kernels-{uid}"]
    with _LOCK:
        for path in candidates:
            try:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                reason = _untrusted_reason(path)
            except OSError:
                logger.debug("kernel cache dir %s not usable", path, exc_info=True)
                continue
            if reason is not None:
                if (str(path), reason) not in _REFUSED:
                    _REFUSED.add((str(path), reason))
                    logger.warning("kernel cache dir %s refused: %s; generated code is not imported from "
                                   "there (next: %s; set SPECONTEXT_KERNEL_CACHE_DIR to a folder only you "
                                   "can write)", path, reason,
                                   "the next default folder" if path != candidates[-1]
                                   else "a private folder for this process")
                continue
            if os.access(path, os.W_OK):
                return path
            logger.debug("kernel cache dir %s not writable", path)
        return _private_dir()


@dataclass(frozen=True)
class CompiledKernels:
    """A generated module, imported.

    Attributes:
        spec: the spec it was generated for.
        source: the generated text (``generated_source(spec)``).
        path: the file the source was written to (the module runs ``source``, not the file).
        module: the imported module (``launch`` plus the ``@triton.jit`` kernels).
        interpreted: whether its kernels were created under ``TRITON_INTERPRET=1``.
    """

    spec: KernelSpec
    source: str
    path: Path
    module: ModuleType
    interpreted: bool

    @property
    def launch(self):
        """The module's ``launch`` function."""
        return self.module.launch


def _write_source(source: str, stem: str) -> Path:
    """Write ``source`` under its content hash in the cache dir (atomic rename); returns the path.
    The file is for Triton's source lookup and for people: imports use the text in memory."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{stem}_{digest}.py"
    try:
        fresh = not (path.is_file() and path.read_text() == source)
    except (OSError, UnicodeDecodeError):
        fresh = True
    if fresh:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{stem}", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(source)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    with _LOCK:
        _WRITTEN[path] = source
    return path


_WRITTEN: dict[Path, str] = {}  # path -> the source this process generated and wrote there


class _SourceLoader(importlib.abc.InspectLoader):
    """Loads a module from source text held in memory, under a file name (for tracebacks and
    ``inspect``); the file on disk is never read."""

    def __init__(self, source: str, path: Path):
        self.source = source
        self.path = str(path)

    def get_source(self, fullname: str) -> str:
        return self.source

    def get_filename(self, fullname: str) -> str:
        return self.path

    def exec_module(self, module: ModuleType) -> None:
        code = compile(self.source, self.path, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the text this process generated, by design


def _import_file(path: Path, source: str | None = None) -> ModuleType:
    """Import the generated module of ``path`` from ``source`` (default: the text this process
    wrote there with :func:`_write_source`; a file it did not write is read once, and those
    very bytes run). ``linecache`` gets the same text, so ``inspect`` (Triton's ``@jit``)
    never reads the file either."""
    path = Path(path)
    if source is None:
        with _LOCK:
            source = _WRITTEN.get(path)
    if source is None:
        source = path.read_text()
    lines = source.splitlines(keepends=True)
    # mtime None: linecache.checkcache() keeps the entry (as for loader-provided sources)
    linecache.cache[str(path)] = (len(source), None, lines, str(path))
    name = f"specontext_compile.codegen._generated.{path.stem}"
    loader = _SourceLoader(source, path)
    module_spec = importlib.util.spec_from_loader(name, loader, origin=str(path))
    if module_spec is None:  # pragma: no cover
        raise ImportError(f"cannot import generated kernel module {path}")
    module_spec.has_location = True  # sets module.__file__
    module = importlib.util.module_from_spec(module_spec)
    loader.exec_module(module)
    return module


@functools.cache
def _load(spec: KernelSpec, interpreted: bool) -> CompiledKernels:
    source = generated_source(spec)
    path = _write_source(source, spec.name)
    module = _import_file(path, source)  # the text generated above, not what is on disk now
    logger.info("compiled %s from %s (interpreter=%s)", spec.name, path, interpreted)
    return CompiledKernels(
        spec=spec, source=source, path=path, module=module, interpreted=interpreted
    )


def load_kernels(spec: KernelSpec) -> CompiledKernels:
    """Generated kernels for ``spec``, compiled once per spec and interpreter mode.

    Raises:
        ImportError: when triton is not installed.
        TypeError: when ``spec`` is not a ``KernelSpec``.
    """
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"expected a KernelSpec, got {type(spec).__name__}")
    if not _triton_importable():
        raise ImportError(
            "the generated kernels need triton: pip install 'specontext-compile"
            "[triton]' (or use the torch path of specontext_compile.runtime)"
        )
    return _load(spec, interpreter_enabled())


def clear_cache() -> None:
    """Forget the in-process cache (files on disk stay; they are keyed by content)."""
    _load.cache_clear()
