"""Machine constants the offload schedule needs, measured once and kept on disk.

The offload scheduling pass (``passes/schedule.py``) places prefetches from a cost model
whose only measured input is the host-to-device copy bandwidth (bytes/s): a layer's
compute estimate is its weight bytes over the same bandwidth (decode is memory bound). A
bandwidth measured afresh while compiling would make the same model compile to different
graphs from run to run, so:

* the option ``copy_bandwidth`` (bytes/s) fixes it explicitly; or
* :func:`copy_bandwidth` measures it once per machine and device and keeps it in a JSON
  file (``$SPECONTEXT_CALIBRATION`` or ``~/.cache/specontext/calibration.json``) keyed by
  the machine (host name, architecture, processor, torch version and the device's name),
  so every later compile on that machine reads the same number.

Either way the value enters the schedule pass's ``uuid`` and the compile report: the same
inputs compile to the same graph. The file holds numbers only (never code); a file that
cannot be read or written is logged and the value is measured for the process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["calibration_path", "copy_bandwidth", "machine_key", "measure_copy_bandwidth"]

_MEASURED: dict[str, float] = {}  # per process: machine key -> bytes/s


def calibration_path() -> Path:
    """The calibration file: ``$SPECONTEXT_CALIBRATION`` or ``~/.cache/specontext/calibration.json``."""
    env = os.environ.get("SPECONTEXT_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "specontext" / "calibration.json"


def machine_key(device: str) -> str:
    """What the bandwidth depends on: host, architecture, processor, torch, device name."""
    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "cpu"
    return "|".join((platform.node(), platform.machine(), platform.processor() or "?",
                     f"torch {torch.__version__}", f"{device}:{name}"))


def measure_copy_bandwidth(device: str = "cpu", nbytes: int = 8 << 20) -> float:
    """Bytes/s of a row gather from the host tier into a device buffer (an 8 MiB
    ``index_select`` + copy, best of 5; read + write bytes)."""
    rows = nbytes // 256
    src = torch.randn(rows, 64, pin_memory=device == "cuda")
    dst = torch.empty(rows, 64, device=device)
    idx = torch.randperm(rows)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src.index_select(0, idx))
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        logger.warning("specontext: ignoring calibration file %s (%s)", path, err)
        return {}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        logger.warning("specontext: cannot keep the calibration in %s (%s); it holds for this process "
                       "only (set $SPECONTEXT_CALIBRATION or the option copy_bandwidth)", path, err)


def copy_bandwidth(device: str = "cpu") -> float:
    """The copy bandwidth of this machine and device in bytes/s: from the calibration file
    when it has this machine's key, else measured once and added to it."""
    key = machine_key(device)
    if key in _MEASURED:
        return _MEASURED[key]
    path = calibration_path()
    data = _read(path)
    value = data.get(key, {}).get("copy_bandwidth") if isinstance(data.get(key), dict) else None
    if not (isinstance(value, (int, float)) and value > 0):
        value = measure_copy_bandwidth(device)
        data[key] = {"copy_bandwidth": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        _write(path, data)
        logger.info("specontext: measured copy bandwidth %.2f GB/s on %s (kept in %s)", value / 1e9, key, path)
    _MEASURED[key] = float(value)
    return _MEASURED[key]
