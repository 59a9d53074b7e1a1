"""Triton kernels for SpeContext (arXiv 2512.00722): sparse decode attention over the
selected tokens (section 4).

Public API:

* ``KernelSpec``: a frozen dataclass, one site's specialisation of the kernels.
* ``kernel_module()``: ``codegen/kernels.py`` (the ``@triton.jit`` kernels) loaded for the
  current Triton mode; ``split_constexprs(spec)``: the ``tl.constexpr`` arguments a spec
  sets (CLI: ``python -m specontext_compile.codegen show --head-dim 128 --group 4``).
* ``sparse_decode_attention(...)``, ``sparse_mla_decode_attention(...)``: validated wrappers.
* ``triton_available()``: whether the kernels can run here (CUDA, or TRITON_INTERPRET=1).
* ``reference_*``: float64 PyTorch oracles.

The modules of this package import triton only when a spec is built or the kernels are first
loaded and change no global state at import. See ``codegen/README.md`` for the invariants.
"""

from .attention import (
    check_selection,
    choose_splits,
    sparse_decode_attention,
    sparse_mla_decode_attention,
)
from .launch import interpreter_enabled, kernel_module, split_constexprs, triton_available
from .reference import reference_sparse_decode_attention
from .spec import KernelSpec

__all__ = [
    "KernelSpec",
    "check_selection",
    "choose_splits",
    "interpreter_enabled",
    "kernel_module",
    "reference_sparse_decode_attention",
    "sparse_decode_attention",
    "sparse_mla_decode_attention",
    "split_constexprs",
    "triton_available",
]
