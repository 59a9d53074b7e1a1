"""The two test tiers of tests/conftest.py (docs/testing.md): a slow test is left out of the
default run and said so, runs with ``--slow``, and runs when named by its node id. Checked by
collecting tests/test_smollm2.py (4 tests, all slow) in a child pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOW_FILE = "tests/test_smollm2.py"
ONE = f"{SLOW_FILE}::test_smollm2_small_budget_recall_and_closeness"


def collect(*args: str) -> str:
    """``pytest --collect-only -q ARGS`` in a child process; its output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


@pytest.mark.parametrize("args, collected, left_out", [  # a child pytest each (~10 s): one fast
    ((SLOW_FILE,), 0, 4),
    pytest.param((SLOW_FILE, "--slow"), 4, 0, marks=pytest.mark.slow),
    pytest.param((ONE,), 1, 0, marks=pytest.mark.slow),
], ids=["default", "--slow", "node-id"])
def test_slow_tests_run_only_when_asked(args, collected, left_out):
    out = collect(*args)
    assert sum(line.startswith(f"{SLOW_FILE}::") for line in out.splitlines()) == collected, out
    hint = f"{left_out} slow-tier tests left out: the full suite is `pytest --slow`"
    assert (hint in out) == bool(left_out), out
