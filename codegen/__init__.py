"""Generated Triton kernels for SpeContext (arXiv 2512.00722): sparse decode attention over the
selected tokens (section 4).

Public API:

* ``KernelSpec``: a frozen dataclass, the cache key of a kernel.
* ``generated_source(spec) -> str``: the Triton source generated for a spec
  (CLI: ``python -m specontext_compile.codegen show --head-dim 128 --group 4 --dtype bf16``).
* ``load_kernels(spec)``: compile once and cache by spec.
* ``sparse_decode_attention(...)``, ``sparse_mla_decode_attention(...)``: validated wrappers.
* ``triton_available()``: whether the kernels can run here (CUDA, or TRITON_INTERPRET=1).
* ``reference_*``: float64 PyTorch oracles.

The modules of this package import triton only when a spec is built or a kernel is first
loaded and change no global state at import. See ``codegen/README.md`` for the invariants.
"""

from .attention import (
    check_selection,
    choose_splits,
    sparse_decode_attention,
    sparse_mla_decode_attention,
)
from .compiler import (
    CompiledKernels,
    cache_dir,
    clear_cache,
    interpreter_enabled,
    load_kernels,
    triton_available,
)
from .generator import generated_source
from .reference import reference_sparse_decode_attention
from .spec import KernelSpec

__all__ = [
    "CompiledKernels",
    "KernelSpec",
    "cache_dir",
    "check_selection",
    "choose_splits",
    "clear_cache",
    "generated_source",
    "interpreter_enabled",
    "load_kernels",
    "reference_sparse_decode_attention",
    "sparse_decode_attention",
    "sparse_mla_decode_attention",
    "triton_available",
]
