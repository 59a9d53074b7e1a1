"""Never silently dense: the ways a decode step can run without the rewrite, said once.

Two ways, both reported as one WARNING each (per frame, per reason) naming the fix, and
counted in ``torch._dynamo.utils.counters["specontext"]``:

- **Dynamo stops compiling a frame** we compiled. After ``recompile_limit`` (8) compiled
  entries on one code object (a budget sweep in one process, a notebook trying settings,
  many cache shapes) dynamo runs the frame *uncompiled*, so its decode steps are Hugging
  Face's dense ones and nothing of ours runs; dynamo's own WARNING names neither the
  backend nor the consequence. :func:`watch_recompile_limit` (installed at the first
  graph the backend compiles, never at import) observes that WARNING on the logger
  ``torch._dynamo.convert_frame`` (a logging filter that changes no record) and, for a
  frame the backend compiled (:func:`note_frame`), adds ours. Counter:
  ``recompile_limit_frames``.
- **A decode graph whose sites stay dense** for a reason other than the user's own
  choice (``dense_layers``): e.g. a graph break without selection state, or a layer shape
  the selection cannot serve (:func:`warn_dense_decode`). Counter: ``dense_decode_sites``.

Invariant: nothing here changes what runs; it only observes and reports.
"""

from __future__ import annotations

import logging
import threading

from .runtime.torch_private import compile_id, counters

__all__ = ["note_frame", "warn_dense_decode", "watch_recompile_limit"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_FRAMES: set[int] = set()  # dynamo frame ids (one per code object) of graphs we compiled
_WARNED_FRAMES: set[int] = set()
_WARNED_REASONS: set[str] = set()
_FILTER: _RecompileLimitFilter | None = None
_BY_CHOICE = "by choice"  # the reason of a site the user keeps dense (option dense_layers)

RECOMPILE_FIX = (
    "calls that match none of its compiled graphs now run uncompiled: dense, without the "
    "specontext step. Fix: compile with specontext_compile.compile(model, ...) (each call "
    "keeps its own graphs: isolate_recompiles), pass torch.compile(..., recompile_limit=N), or "
    "raise torch._dynamo.config.recompile_limit; torch.compiler.reset() drops graphs of earlier "
    "settings")


def _frame_id() -> int | None:
    current = compile_id()
    return None if current is None else current.frame_id


def note_frame() -> None:
    """Record that the frame dynamo is compiling now went through the backend (its first
    compile — a new frame, or one after ``torch._dynamo.reset()`` — may be warned again)."""
    current = compile_id()
    if current is None or current.frame_id is None:
        return
    with _LOCK:
        _FRAMES.add(current.frame_id)
        if current.frame_compile_id == 0:
            _WARNED_FRAMES.discard(current.frame_id)


class _RecompileLimitFilter(logging.Filter):
    """Sees dynamo's "hit config.recompile_limit" WARNING; passes every record unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if record.levelno >= logging.WARNING and "hit config.%s" in str(record.msg):
                _on_recompile_limit(record)
        except Exception:  # noqa: BLE001 - an observer must never break dynamo's logging
            logger.debug("specontext: could not read dynamo's recompile-limit record", exc_info=True)
        return True


def _on_recompile_limit(record: logging.LogRecord) -> None:
    frame = _frame_id()
    with _LOCK:
        if frame is None or frame not in _FRAMES or frame in _WARNED_FRAMES:
            return
        _WARNED_FRAMES.add(frame)
    args = record.args if isinstance(record.args, tuple) else ()
    limit_type = args[0] if len(args) > 0 else "recompile_limit"
    limit = args[1] if len(args) > 1 else "?"
    function = args[2] if len(args) > 2 else "a compiled function"
    counters["specontext"]["recompile_limit_frames"] += 1
    logger.warning("specontext: dynamo hit %s (%s) on %s, compiled with backend=\"specontext\"; %s",
                   limit_type, limit, function, RECOMPILE_FIX)


def watch_recompile_limit() -> None:
    """Install the observer of dynamo's recompile-limit WARNING (once per process)."""
    global _FILTER
    with _LOCK:
        if _FILTER is not None:
            return
        _FILTER = _RecompileLimitFilter()
    logging.getLogger("torch._dynamo.convert_frame").addFilter(_FILTER)


def warn_dense_decode(result, where: str, writes_store: bool = False) -> int:
    """One WARNING per distinct reason when a decode graph keeps sites dense for a reason
    the user did not choose, or a graph that writes our KV stores has sites whose store the
    pass could not resolve (``writes_store``: e.g. ``output_attentions=True``); returns how
    many such sites the graph has (also counted)."""
    if not (result.phase == "decode" or (result.phase == "none" and writes_store)):
        return 0
    sites = [s for s in result.sites if s.reason and _BY_CHOICE not in s.reason]
    counters["specontext"]["dense_decode_sites"] += len(sites)
    for site in sites:
        with _LOCK:
            if site.reason in _WARNED_REASONS:
                continue
            _WARNED_REASONS.add(site.reason)
        logger.warning("specontext: %s, %s runs dense: %s",
                       where, result.site_label(site), site.reason)
    return len(sites)
