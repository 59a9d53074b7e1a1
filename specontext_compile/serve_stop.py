"""Stop strings (the OpenAI field ``stop``) for ``specontext serve``.

Hugging Face's continuous-batching engine takes no stop strings: a request's ``stop`` reached
its handlers, which passed it on, and the engine dropped it (the answer ran to ``max_tokens``).
Here the API server applies them to the text it receives, as OpenAI's API defines them: the
answer ends *before* the first stop string generated (which is not returned), with
``finish_reason`` ``"stop"``, and the request is cancelled in the engine at once, so its
remaining tokens are not generated. A streamed answer holds back only the text that could
still begin a stop string.

:class:`ServedEngine` wraps the engine client a handler uses for one request: it names the
model as the server was started (not by its resolved path) and applies the request's stop
strings to both entry points.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

__all__ = ["ServedEngine", "StopFilter", "first_stop", "held_back"]


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the answer ends: the start of the stop string completed first
    (the earliest end; of two ending together, the longer), as generating ``text`` token by
    token meets it; None if no stop string occurs."""
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
    return min(found)[1] if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (and may complete
    it with the next text): what a stream must not send yet."""
    return max((k for stop in stops for k in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:k])), default=0)


class StopFilter:
    """A stream's output queue (see ``Detokenizer``: answer text, reasoning, tool calls, then
    ``None`` or an error) cut at the first stop string of the answer text: what comes before
    it, then ``None``; the request is cancelled in the engine (``streamer.cancel()``). Offers
    the three queue methods Hugging Face's handlers read (``get``, ``empty``, ``get_nowait``)."""

    def __init__(self, queue, streamer, stops: tuple[str, ...]):
        self._queue, self._streamer, self._stops = queue, streamer, stops
        self._held = ""
        self._ready: collections.deque = collections.deque()
        self._ended = False

    def _feed(self, item: Any) -> None:
        if type(item) is str:  # answer text (reasoning and tool calls are str subclasses or objects)
            text = self._held + item
            cut = first_stop(text, self._stops)
            if cut is not None:
                self._end(text[:cut])
                self._streamer.cancel()
                return
            keep = held_back(text, self._stops)
            self._held = text[len(text) - keep:]
            if len(text) > keep:
                self._ready.append(text[:len(text) - keep])
        elif item is None:
            self._end(self._held)
        else:
            self._ready.append(item)

    def _end(self, text: str) -> None:
        if text:
            self._ready.append(text)
        self._ready.append(None)
        self._held, self._ended = "", True

    async def get(self) -> Any:
        while not self._ready:
            self._feed(await self._queue.get())
        return self._ready.popleft()

    def _drain(self) -> None:
        while not self._ready and not self._ended and not self._queue.empty():
            self._feed(self._queue.get_nowait())

    def empty(self) -> bool:
        self._drain()
        return not self._ready

    def get_nowait(self) -> Any:
        self._drain()
        if not self._ready:
            raise asyncio.QueueEmpty
        return self._ready.popleft()


def _stops(generation_kwargs: dict) -> tuple[str, ...]:
    """The request's stop strings, taken out of ``generation_kwargs`` (the engine drops them)."""
    stops = generation_kwargs.pop("stop_strings", None)
    if stops is None:
        return ()
    return (stops,) if isinstance(stops, str) else tuple(stops)


class ServedEngine:
    """Hugging Face's ``EngineClient`` as one request's handler sees it: ``model_id`` is the
    name the server was started with, and the request's stop strings apply (module doc).
    Every other attribute is the client's."""

    def __init__(self, engine, model_name: str):
        self._engine, self.model_id = engine, model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate_streaming(self, inputs: dict, generation_kwargs: dict, *args, **kwargs):
        stops = _stops(generation_kwargs)
        queue, streamer = self._engine.generate_streaming(inputs, generation_kwargs, *args, **kwargs)
        return (StopFilter(queue, streamer, stops) if stops else queue), streamer

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
        """The answer's text, the prompt's length and the generated tokens; with stop strings,
        streamed from the engine so that generation ends at the first one (the tokens are those
        received until then)."""
        stops = _stops(generation_kwargs)
        if not stops:
            return await self._engine.generate_non_streaming(inputs, generation_kwargs)
        queue, streamer = self._engine.generate_streaming(inputs, generation_kwargs)
        tokens: list[int] = []
        put_token = streamer.put_token

        def recording(token: int) -> None:  # runs on this event loop, which is ours until the first await
            tokens.append(token)
            put_token(token)

        streamer.put_token = recording
        stream, parts = StopFilter(queue, streamer, stops), []
        try:
            while (item := await stream.get()) is not None:
                if hasattr(item, "msg"):  # the stream's error: the request failed in the engine
                    raise RuntimeError(item.msg)
                parts.append(item)
        finally:
            streamer.cancel()  # ended at a stop string or failed: the engine stops generating
        from transformers.cli.serving.utils import prompt_length

        return "".join(parts), prompt_length(inputs), tokens
