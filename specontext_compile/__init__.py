"""specontext: a ``torch.compile`` backend for speculative context sparsity (SpeContext,
arXiv 2512.00722). ``torch.compile(model.forward, backend="specontext", options={...})``.

Importing this package registers the ``specontext::`` custom ops and, with torch's
``torch.fx.node.has_side_effect``, the step functions that change tensors in place (so FX's
dead-code elimination keeps them); it changes no other global state, and it loads the compiler only: the serving helpers (``continuous_batching_config``) and
the explain tool (``explain``) load on first use (``tests/test_layers.py``).
"""

from .api import compile, restore
from .backend import CompileReport, compile_reports, specontext_backend
from .config import SpeContextConfig
from .runtime.kv_cache import SpeContextCache
from .runtime.static_state import path_counts

_LAZY = {"explain": ("explain_report", "explain"), "continuous_batching_config": ("serving", "continuous_batching_config")}

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


def __getattr__(name: str):
    """The tools' entry points, imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
