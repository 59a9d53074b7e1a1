"""specontext inside vLLM (issue 54): speculative sparse decoding as vLLM's CPU attention backend.

Installed in vLLM's venv (``bash scripts/vllm_venv.sh``), the package's ``vllm.general_plugins``
entry point (:func:`register`) runs in every vLLM process and overrides vLLM's ``CPU_ATTN``
backend with :class:`~.backend.SpeContextCPUBackend`, which is vLLM's CPU attention unchanged
unless the engine is given options: ``LLM(model, additional_config={"specontext": {"budget":
1024}})``. What it builds and what it does not yet: :mod:`.backend`.
"""

from __future__ import annotations

__all__ = ["register", "worker_counters"]

BACKEND = "specontext_vllm.backend.SpeContextCPUBackend"


def register() -> None:
    """vLLM's plugin hook: make ``CPU_ATTN`` name our backend (vLLM's CPU platform always picks
    that entry). Imports vLLM; call it only where vLLM is installed."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)


def worker_counters(worker: object = None) -> dict[str, int]:
    """The plugin's counters (``torch._dynamo.utils.counters["specontext_vllm"]``) in the process
    that calls it. With several workers (tensor parallelism) each rank counts its own:
    ``llm.collective_rpc(worker_counters)`` gathers them (vLLM passes the worker; a function
    crosses to worker processes only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    from specontext_compile.runtime.torch_private import counters

    return dict(counters["specontext_vllm"])
