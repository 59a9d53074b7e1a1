"""Side streams for KV prefetch: one start/wait interface on CUDA and on CPU.

SpeContext (arXiv 2512.00722, section 5, asynchronous prefetch) fetches the selected KV of
every offloaded layer from host memory on side CUDA streams while earlier layers compute.

* CUDA: :class:`CopyStream` runs each job on its own ``torch.cuda.Stream`` and records an
  event; :meth:`CopyTicket.wait` makes the current stream wait on that event (no host sync).
* CPU: the "stream" is one worker thread; :meth:`CopyTicket.wait` blocks until the job has
  finished. Torch releases the GIL inside its kernels, so the copies overlap with compute
  on the main thread.

In both cases an exception raised by a job is kept and re-raised by :meth:`CopyTicket.wait`
(never at submit time), so a failed copy surfaces exactly where its result is needed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["CopyStream", "CopyTicket"]


class CopyTicket:
    """Handle of one submitted copy job; :meth:`wait` returns its result or raises its error."""

    def __init__(self, future: concurrent.futures.Future | None = None,
                 event: Any = None, result: Any = None, error: BaseException | None = None):
        self._future, self._event, self._result, self._error = future, event, result, error
        self.submitted_at = time.perf_counter()

    def done(self) -> bool:
        """True when the job has finished (CPU) or its event has completed (CUDA)."""
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def wait(self) -> Any:
        """Block (CPU) or order the current stream after the copy (CUDA); return the job's
        result. Raises the job's exception, if it raised one."""
        if self._future is not None:
            return self._future.result()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self._result


class CopyStream:
    """Runs copy jobs off the critical path.

    Args:
        device: the device tier's device; ``cuda`` uses a CUDA side stream with events,
            anything else a single worker thread (jobs run in submission order).
        inline: run each job on the calling thread when it is submitted (no overlap; its
            error is raised at the wait, as from the worker): what the worker thread costs
            on a machine without a spare core (``benchmarks.offload_step --inline-copies``).
    """

    def __init__(self, device: torch.device | str = "cpu", inline: bool = False):
        self.device = torch.device(device)
        self._stream = None
        self._pool = None
        self.inline = inline
        if inline:
            return
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="specontext-prefetch")

    @property
    def kind(self) -> str:
        """``"cuda-stream"``, ``"cpu-thread"`` or ``"inline"``."""
        if self.inline:
            return "inline"
        return "cuda-stream" if self._stream is not None else "cpu-thread"

    def submit(self, fn: Callable[..., Any], *args: Any) -> CopyTicket:
        """Start ``fn(*args)`` on the side stream / worker; returns at once (inline: after it)."""
        if self.inline:
            try:
                return CopyTicket(result=fn(*args))
            except BaseException as exc:  # surfaced at wait(), like the worker's
                return CopyTicket(error=exc)
        if self._pool is not None:
            return CopyTicket(future=self._pool.submit(fn, *args))
        # CUDA: issue the job's kernels and copies on the side stream (they run async)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self._stream):
                result = fn(*args)
        except BaseException as exc:  # surfaced at wait(), like the CPU worker
            return CopyTicket(error=exc)
        event = torch.cuda.Event()
        event.record(self._stream)
        return CopyTicket(event=event, result=result)

    def close(self) -> None:
        """Finish queued jobs and stop the worker (CPU)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
