"""The command line's JSON reports: written whole or not at all (``write_json``).

Used by ``specontext run`` and ``specontext explain`` (``cli.py``, ``explain_cli.py``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["write_json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _json_safe(data):
    """``data`` with infinite floats (``candidates=inf``) as the string ``"inf"``: strict JSON
    has no Infinity."""
    if isinstance(data, float) and math.isinf(data):
        return "inf" if data > 0 else "-inf"
    if isinstance(data, dict):
        return {k: _json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_json_safe(v) for v in data]
    return data


def write_json(path: Path, data, what: str) -> int:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename (a reader never
    sees half a file; an old file survives a failed write). If that fails after all (the folder
    vanished, the disk filled up), the figures go to a file in the temp dir instead of being lost.
    Returns the exit code: 0, or 1 when the fallback was used."""
    text = json.dumps(_json_safe(data), indent=2) + "\n"
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report gets the usual mode
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        fd, rescue = tempfile.mkstemp(prefix=f"specontext-{path.stem}-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"specontext: cannot write {path} ({exc.strerror or exc}); {what} saved to {rescue} instead",
              file=sys.stderr)
        return 1
    print(f"{what} written to {path}")
    return 0
