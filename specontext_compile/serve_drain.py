"""Stopping a server with requests in flight: each gets a few seconds, then a clear error.

uvicorn stops on Ctrl-C (or :meth:`~specontext_compile.serve.Server.stop`) by waiting for the
running requests up to its graceful-shutdown timeout, then cancelling them; the cancellation
ran through Hugging Face's handlers and uvicorn logged it as an "Exception in ASGI
application" with a traceback, and the client got a cut connection (a stream simply stopped
mid-answer). :class:`Draining` wraps the application: when the server starts stopping, each
request still running gets ``grace`` seconds to finish; then it is cancelled and its client
gets an answer that says why — a 503 with an OpenAI-style error body when nothing was sent
yet, or a last ``data: {"error": ...}`` event and ``data: [DONE]`` on a stream (the ``openai``
client raises it as an ``APIError``). Requests that arrive while the server stops get the
503 at once. uvicorn's own timeout stays above ``grace``, so it has nothing left to cancel.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Draining", "STOPPING_STATUS"]

STOPPING_STATUS = 503


def _error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_stopping", "code": STOPPING_STATUS}}


class _Response:
    """What one request has sent so far (the ASGI ``send`` it was given, watched)."""

    def __init__(self, send):
        self._send = send
        self.started = False
        self.ended = False
        self.streaming = False

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def end_with_error(self, message: str) -> None:
        """Finish the response with ``message``: a 503 if nothing was sent, an error event on a
        stream; nothing if it had already ended."""
        if self.ended:
            return
        body = _error_body(message)
        if not self.started:
            await self.send({"type": "http.response.start", "status": STOPPING_STATUS,
                             "headers": [(b"content-type", b"application/json")]})
            await self.send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        tail = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n" if self.streaming else ""
        await self.send({"type": "http.response.body", "body": tail.encode()})


class Draining:
    """ASGI middleware: requests in flight when the server stops get ``grace`` seconds, then an
    error response naming the stop (module docstring).

    Args:
        app: the ASGI application (Hugging Face's FastAPI app).
        grace: seconds a running request may still take once the server stops (>= 0).

    Raises:
        ValueError: ``grace`` is negative.
    """

    def __init__(self, app, grace: float = 5.0):
        if grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        self.app = app
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stopped = False

    def stop(self, grace: float | None = None) -> None:
        """The server starts stopping (thread-safe; a signal handler may call it)."""
        if grace is not None:
            self.grace = grace
        self._stopped = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._loop is None:
            self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
            if self._stopped:
                self._stopping.set()
        response = _Response(send)
        if self._stopping.is_set():
            await response.end_with_error("the server is stopping; send the request to a running server")
            return
        await self._run(self.app(scope, receive, response.send), response, scope.get("path", ""))

    async def _run(self, request, response: _Response, path: str) -> None:
        running = asyncio.ensure_future(request)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                await asyncio.wait({running}, timeout=self.grace)
            if running.done():
                running.result()  # the request's own outcome, errors included
                return
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            logger.warning("server stopping: %s cancelled after %.1f s of grace", path, self.grace)
            await response.end_with_error(
                f"the server stopped; this request was cancelled after {self.grace:g} s of grace. "
                "Send it again to a running server")
        finally:
            stopping.cancel()
            if not running.done():  # this task itself was cancelled (uvicorn's own timeout)
                running.cancel()
