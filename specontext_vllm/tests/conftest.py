"""The plugin's tests run in vLLM's venv (``bash scripts/vllm_venv.sh``):
``.venv-vllm/bin/python -m pytest -q specontext_vllm/tests`` (the main suite runs them so,
``tests/test_vllm_plugin.py``). vLLM on 2 cores: bind both, reserve none."""

import os

import pytest
import torch
import transformers

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: counters readable


TINY_LAYERS = 4  # the tiny Llama's decoder layers (the tests count rows x layers)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama saved for vLLM: 4 layers, 4 query / 2 KV heads, head_dim 64, vocab
    256, 1024 positions, fp32 (the engine tests' model)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=1024,
        initializer_range=0.15, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture
def take_path(monkeypatch):
    """``take_path(path, available, kernel)``: run the test on one path of a plugin kernel,
    ``"kernel"`` (skipped where ``kernels.<available>()`` is False) or ``"torch"`` (that
    function made False); returns the list each call of ``kernels.<kernel>`` appends to, so the
    test asserts which path ran."""
    from specontext_vllm import kernels

    def take(path: str, available: str, kernel: str) -> list:
        if path == "kernel" and not getattr(kernels, available)():
            pytest.skip(f"the plugin's C++ kernel ({kernel}) does not build here")
        calls = []
        if path == "torch":
            monkeypatch.setattr(kernels, available, lambda: False)
        else:
            real = getattr(kernels, kernel)
            monkeypatch.setattr(kernels, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
        return calls

    return take
