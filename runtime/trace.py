"""Chrome-trace recording of decode steps (open the JSON in chrome://tracing or Perfetto).

Spans are "complete" events (``"ph": "X"``) with microsecond timestamps; the thread id
tells apart the main thread (compute, waits) and the prefetch worker (copies), so overlap
of copies with compute shows as parallel bars.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Collects spans of the current decode step; :meth:`end_step` keeps the finished step.

    Thread-safe: the prefetch worker records its copies into the same step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self.last_step: list[dict[str, Any]] = []
        self.last_step_index: int | None = None
        self._threads: dict[int, str] = {}

    def now_us(self) -> float:
        """Microseconds since the recorder was made."""
        return (time.perf_counter() - self._origin) * 1e6

    def add(self, name: str, cat: str, start_us: float, end_us: float, **args: Any) -> None:
        """Record a span ``[start_us, end_us]`` on the calling thread."""
        tid = threading.get_ident()
        with self._lock:
            self._threads.setdefault(tid, threading.current_thread().name)
            self._events.append({"name": name, "cat": cat, "ph": "X", "ts": start_us,
                                 "dur": max(end_us - start_us, 0.0), "pid": 0, "tid": tid,
                                 "args": args})

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the time spent in the ``with`` block."""
        start = self.now_us()
        try:
            yield
        finally:
            self.add(name, cat, start, self.now_us(), **args)

    def end_step(self, step: int) -> None:
        """Keep the events recorded so far as decode step ``step`` and start a new step."""
        with self._lock:
            if self._events:
                self.last_step, self.last_step_index = self._events, step
            self._events = []

    def to_json(self) -> dict[str, Any]:
        """The last finished step in Chrome's trace-event format."""
        meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
                for tid, name in self._threads.items()]
        return {"traceEvents": meta + list(self.last_step), "displayTimeUnit": "ms",
                "otherData": {"decode_step": self.last_step_index}}

    def write(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path
