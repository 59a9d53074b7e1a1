"""Family matrix helpers: the tiny random decoders of ``specontext_compile.tiny_models`` run
eagerly (dense) and through the specontext backend (``tests/_family_matrix.py``)."""

from __future__ import annotations

from _family_matrix import BUDGET, DECODE_STEPS, PROMPT_TOKENS, run_family  # noqa: F401
from specontext_compile.tiny_models import FAMILIES, VOCAB, tiny_family  # noqa: F401


def record_caches(monkeypatch) -> list:
    """Keep every ``SpeContextCache`` that ``run_family`` builds (it does not return its
    cache), so that the test can read the compiled step's path counters."""
    import specontext_compile as sc

    caches, real = [], sc.SpeContextCache

    def build(*args, **kwargs):
        caches.append(real(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(sc, "SpeContextCache", build)
    return caches
