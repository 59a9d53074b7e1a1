"""The vLLM plugin's own tests (``specontext_vllm/tests``: layouts, selection against float64,
engines on a tiny Llama) in vLLM's venv, which pins other versions than this one: made by
``bash scripts/vllm_venv.sh`` (the README's test command runs it first)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.xdist_group("test_vllm_plugin")


NO_VENV = "no .venv-vllm: run `bash scripts/vllm_venv.sh` (the README's test command does)"


def _run_in_vllms_venv(tier: str) -> None:
    done = subprocess.run([str(VENV), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", tier,
                           "specontext_vllm/tests"], cwd=ROOT, capture_output=True, text=True, timeout=880, check=False)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
    sys.stdout.write(done.stdout.strip().splitlines()[-1] + "\n")


@pytest.mark.skipif(not VENV.exists(), reason=NO_VENV)
@pytest.mark.timeout(900)
def test_the_plugins_tests_pass_in_vllms_venv():
    _run_in_vllms_venv("not slow")


@pytest.mark.slow
@pytest.mark.skipif(not VENV.exists(), reason=NO_VENV)
@pytest.mark.timeout(900)
def test_the_plugins_slow_tests_pass_in_vllms_venv():
    """The plugin's slow tier: tensor parallelism with 2 ranks (worker processes)."""
    _run_in_vllms_venv("slow")
