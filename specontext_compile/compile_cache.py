"""Compiled decode steps reused by a later process: a first token in seconds (issue 51, item 4).

A decode step's first call compiles it: dynamo traces the model, our pass rewrites the
graph, and inductor compiles each distinct region (AOTAutograd's trace, inductor's codegen,
the C++ compile of its kernels). torch keeps the products in on-disk caches (inductor's FX
graph cache, AOTAutograd's cache, the compiled kernels; ``TORCHINDUCTOR_CACHE_DIR``, by
default under ``/tmp``), so a second process on the same machine skips all but dynamo's
trace and our pass. The backend keys those caches on a hash of its own sources and options
(``backend._SourcesKey``, ``backend._cacheable_functions``), so a change of either compiles
anew instead of loading a stale step.

This module makes the same artifacts portable: :func:`save` writes what this process
compiled or loaded (``torch.compiler.save_cache_artifacts``) to one file, and :func:`load`
puts a file's artifacts into this process's caches before the first compile
(``torch.compiler.load_cache_artifacts``): a deploy step or a container image ships the
file beside the model, and the first decode step of a fresh machine loads instead of
compiling. ``specontext run --compile-cache FILE`` does both.

Invariants: loading never changes what runs, only whether it is compiled again (a file
from another torch, specontext or option set simply misses); a missing file is not an
error (the first run makes it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["load", "save"]


def _summary(info) -> str:
    """``CacheInfo`` as ``"inductor 5, aot_autograd 5"`` (artifact kind: count)."""
    return ", ".join(f"{kind} {len(keys)}" for kind, keys in sorted(info.artifacts.items()) if keys) or "none"


def load(path: str | os.PathLike) -> bool:
    """Load the compile artifacts saved in ``path`` into this process's caches.

    Call before the first compile. Returns True when artifacts were loaded, False when
    ``path`` does not exist yet or held none (logged at INFO: the first run makes it).

    Raises:
        ValueError: ``path`` exists but is not a file of ``torch.compiler.save_cache_artifacts``
            (e.g. another file given by mistake, or a truncated copy), naming the path and the fix.
    """
    path = Path(path)
    if not path.exists():
        logger.info("specontext: no compile cache at %s yet; this run compiles and can save it there", path)
        return False
    refused = (f"{path} is not a compile cache saved by specontext or torch.compiler.save_cache_artifacts; "
               f"delete it or give another path, and the next run saves a new one")
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # noqa: BLE001 (torch raises several kinds for a file it cannot read)
        raise ValueError(f"{refused} ({type(err).__name__}: {err})") from err
    if info is None:  # torch logs a corrupt file and returns None
        raise ValueError(refused)
    if info.empty():
        logger.info("specontext: the compile cache %s held no artifacts", path)
        return False
    logger.info("specontext: loaded the compile cache %s (%s)", path, _summary(info))
    return True


def save(path: str | os.PathLike) -> int:
    """Write every compile artifact this process made or loaded to ``path`` (its folder is
    made), replacing the file atomically. Returns the bytes written (0 when nothing was
    compiled: nothing is written then)."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        logger.info("specontext: nothing was compiled in this process; %s left as it is", path)
        return 0
    data, info = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)
    logger.info("specontext: saved the compile cache %s (%d bytes: %s)", path, len(data), _summary(info))
    return len(data)
