"""Requests in flight when the server stops (``serve_drain.Draining``), on stand-in ASGI
applications: each finishes within its grace untouched, or is cancelled and answered with an
error that names the stop (a 503 before anything was sent, an error event and ``[DONE]`` on a
stream); requests arriving while the server stops get the 503 at once. The real server's
stop with a stream and a plain request in flight: tests/test_serve.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from specontext_compile.serve_drain import STOPPING_STATUS, Draining

SCOPE = {"type": "http", "path": "/v1/chat/completions"}


async def _receive():
    await asyncio.sleep(3600)


def _app(seconds: float, stream: bool, cancelled: list):
    """A handler that answers after ``seconds`` (a stream: one chunk first, then the rest)."""

    async def app(scope, receive, send):
        kind = b"text/event-stream" if stream else b"application/json"
        try:
            if stream:
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
                await send({"type": "http.response.body", "body": b"data: {\"first\": 1}\n\n", "more_body": True})
                await asyncio.sleep(seconds)
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            else:
                await asyncio.sleep(seconds)
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
                await send({"type": "http.response.body", "body": b"{\"ok\": true}"})
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    return app


async def _serve(app, stop_after: float | None, grace: float):
    """Run one request through Draining; stop the server ``stop_after`` seconds in. Returns the
    messages sent and the seconds the request took."""
    draining, sent = Draining(app, grace), []

    async def send(message):
        sent.append(message)

    loop = asyncio.get_running_loop()
    start = loop.time()
    request = asyncio.ensure_future(draining(dict(SCOPE), _receive, send))
    if stop_after is not None:
        await asyncio.sleep(stop_after)
        draining.stop()
    await request
    return draining, sent, loop.time() - start


def _body(sent) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _status(sent) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_request_that_ends_within_its_grace_is_untouched():
    cancelled = []
    _, sent, seconds = asyncio.run(_serve(_app(0.2, stream=False, cancelled=cancelled), stop_after=0.05, grace=2.0))
    assert _status(sent) == 200 and json.loads(_body(sent)) == {"ok": True}
    assert not cancelled and seconds < 1.5


def test_a_plain_request_past_its_grace_gets_a_503_naming_the_stop():
    cancelled = []
    _, sent, seconds = asyncio.run(_serve(_app(30, stream=False, cancelled=cancelled), stop_after=0.05, grace=0.2))
    assert cancelled == [True]
    assert _status(sent) == STOPPING_STATUS
    error = json.loads(_body(sent))["error"]
    assert error["type"] == "server_stopping" and "server stopped" in error["message"]
    assert seconds < 5  # the grace, not the handler's 30 s


def test_a_stream_past_its_grace_ends_with_an_error_event_and_done():
    cancelled = []
    _, sent, _ = asyncio.run(_serve(_app(30, stream=True, cancelled=cancelled), stop_after=0.05, grace=0.1))
    assert cancelled == [True] and _status(sent) == 200
    events = [e for e in _body(sent).decode().split("\n\n") if e]
    assert events[0] == 'data: {"first": 1}'
    assert json.loads(events[1].removeprefix("data: "))["error"]["type"] == "server_stopping"
    assert events[2] == "data: [DONE]" and len(events) == 3
    assert sent[-1].get("more_body", False) is False  # the response is finished, not cut


def test_a_request_arriving_while_the_server_stops_gets_the_503_at_once():
    async def run():
        calls = []

        async def app(scope, receive, send):
            calls.append(scope)

        draining, sent = Draining(app, 5.0), []
        draining.stop()  # before any request: no loop known yet

        async def send(message):
            sent.append(message)

        await draining(dict(SCOPE), _receive, send)
        return calls, sent

    calls, sent = asyncio.run(run())
    assert not calls and _status(sent) == STOPPING_STATUS
    assert "server is stopping" in json.loads(_body(sent))["error"]["message"]


def test_a_failing_request_keeps_its_own_error():
    async def app(scope, receive, send):
        raise KeyError("the handler's own")

    with pytest.raises(KeyError, match="the handler's own"):
        asyncio.run(_serve(app, stop_after=None, grace=1.0))


def test_a_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace must be >= 0"):
        Draining(lambda *a: None, -1)
