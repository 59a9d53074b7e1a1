"""specontext: a ``torch.compile`` backend for speculative context sparsity (SpeContext,
arXiv 2512.00722). ``torch.compile(model.forward, backend="specontext", options={...})``.

Importing this package registers the ``specontext::`` custom ops; it changes no other global
state.
"""

from .api import compile, restore
from .backend import CompileReport, compile_reports, specontext_backend
from .config import SpeContextConfig
from .explain import explain
from .runtime.kv_cache import SpeContextCache
from .runtime.static_state import path_counts
from .serving import continuous_batching_config

__all__ = [
           "CompileReport",
           "SpeContextCache",
           "SpeContextConfig",
           "compile",
           "compile_reports",
           "continuous_batching_config",
           "explain",
           "path_counts",
           "restore",
           "specontext_backend",
]
__version__ = "0.1.0"
