"""The plugin's tests run in vLLM's venv (``bash scripts/vllm_venv.sh``):
``.venv-vllm/bin/python -m pytest -q specontext_vllm/tests`` (the main suite runs them so,
``tests/test_vllm_plugin.py``). vLLM on 2 cores: bind both, reserve none."""

import os

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: counters readable
