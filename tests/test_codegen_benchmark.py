"""python -m benchmarks.gpu_kernels must at least import, print --help and run --dry-run on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, tmp_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(tmp_env or {}))
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --dry-run
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kernels", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


def test_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and "budget" in proc.stdout


def test_dry_run(tmp_path):
    out = tmp_path / "results.json"
    proc = _run("--dry-run", "--output", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "copy bandwidth" in proc.stdout and "speed-up over dense" in proc.stdout
    results = json.loads(out.read_text())
    assert results["failures"] == [] and len(results["rows"]) == 4
