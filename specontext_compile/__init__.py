"""specontext: a ``torch.compile`` backend for speculative context sparsity (SpeContext,
arXiv 2512.00722). ``torch.compile(model.forward, backend="specontext", options={...})``.

Importing this package registers the ``specontext::`` custom ops; it changes no other global
state.
"""

from .backend import CompileReport, compile_reports, specontext_backend
from .config import SpeContextConfig
from .runtime.kv_cache import SpeContextCache
from .api import compile

__all__ = ["compile", "specontext_backend", "SpeContextConfig", "SpeContextCache",
           "CompileReport", "compile_reports"]
__version__ = "0.1.0"
