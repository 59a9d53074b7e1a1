"""What ``specontext serve`` runs in the model's process (transformers 5.25 and later).

From transformers 5.25 ``transformers serve`` loads each model in a process of its own
(``EngineClient.start_process``, a ``spawn`` process): the API server keeps the model's config
and processor, the model's process gets copies of the server's ``ModelLoader`` and
``GenerationState``, loads the model with the loader, and hands every request to a runner
(``CBGenerateRunner`` with continuous batching). The continuous-batching configuration with
our backend (:func:`~.serving.continuous_batching_config`) holds the compile backend and
needs the loaded model, so it can neither be made in the API server nor travel to the
model's process: it is made there, right after the model loads.

- :class:`SpeContextLoader` loads as Hugging Face's loader does, then makes that
  configuration (whose backend raises torch's recompile limit to the engine's padded shapes
  in the engine's own thread: torch's config overrides are thread-local).
- :class:`SpeContextGenerationState` gives the runner that configuration as its
  ``cb_config``. Both objects travel in one pickle (the model process's arguments), so the
  state's ``loader`` is the loader that loaded the model there.
- :func:`engine_counts` runs in the model's process (``EngineClient.submit``) and returns the
  backend's path counters.

Invariant: a model's process never serves a request dense by accident. If the configuration
is missing when the runner starts there (the loader did not run in that process), or the
model is no text model, :meth:`SpeContextGenerationState.use_continuous_batching` raises, and
the process reports that loading failed. (The API server asks the same question to tokenize
for continuous batching; there the configuration is None by design.)

Needs transformers 5.25+ with the serving extra: importing this module imports Hugging Face's
serving stack.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import GenerationState

logger = logging.getLogger(__name__)

__all__ = ["SpeContextGenerationState", "SpeContextLoader", "engine_counts", "engine_shapes", "sample_per_request"]


def engine_shapes(engine: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's ``ContinuousBatchingConfig`` fields for a server (each padded shape
    compiles once), ``engine`` completed with:

    - ``max_requests_per_batch`` = 8 and ``q_padding_interval_size`` = it: a decode step
      pads its queries to it. Hugging Face's fallback, 64, made a one-request decode step
      score 64 query rows, several times slower (docs/serving.md, the padded query rows).
    - ``kv_padding_interval_size`` = the cache's tokens (``num_blocks`` x ``page_size``): one
      KV size, so only the query size varies.
    """
    engine = dict(engine or {})
    requests = engine.setdefault("max_requests_per_batch", 8)
    engine.setdefault("q_padding_interval_size", requests)
    if engine.get("num_blocks"):
        engine.setdefault("kv_padding_interval_size", engine["num_blocks"] * engine.get("page_size", 256))
    return engine


#: the engine's sampling defaults where the model's generation config does not sample: never
#: read by a request (a sampling request carries its temperature, top-k and top-p; a greedy one
#: top_k=1, which leaves one token whatever the others), only there so that Hugging Face builds
#: each per-request processor (it builds none for a neutral value: temperature 1, top_p 1)
_SAMPLING_DEFAULTS = {"temperature": 0.7, "top_k": 50, "top_p": 0.95}


def sample_per_request(generation_config) -> None:
    """Make the engine able to sample with each request's own temperature, top-k and top-p.

    Hugging Face's continuous-batching engine samples only when the model's generation
    config does (``do_sample``), and applies a request's temperature, top-k or top-p only
    through a processor it builds from that config's non-neutral values; on a greedy model
    (SmolLM2's GGUF) a request's ``temperature: 1.5`` gave the greedy text. Here, in the model's
    process, a greedy config is turned into a sampling one whose processors exist
    (:data:`_SAMPLING_DEFAULTS`); a greedy request stays greedy (the API server sends it as
    ``top_k=1``: one token left, sampled with probability 1), and the API server asks for
    sampling only when a request sets ``temperature > 0`` (:mod:`.serve`), so a request without
    a temperature still decodes as the model's config says. A config that samples already is
    left as it is."""
    if generation_config.do_sample:
        return
    generation_config.do_sample = True
    for name, value in _SAMPLING_DEFAULTS.items():
        setattr(generation_config, name, value)


def _exit_cleanly_on_stop() -> None:
    """In the model's process (its main thread): Ctrl-C is the API server's to handle (a
    terminal sends it to the whole process group; the server stops this process itself, after
    draining), and SIGTERM, which Hugging Face's shutdown sends, exits through Python's exit
    path instead of dying on the signal, so that the process's finalizers run: multiprocessing
    then unregisters what this process made (inductor's compile pool's semaphores among them),
    and the resource tracker finds nothing leaked at shutdown."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    def stop(signum, frame):
        from multiprocessing import util

        util._exit_function()  # multiprocessing's own exit path: finalizers, child processes
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)


class SpeContextLoader(ModelLoader):
    """Hugging Face's model loader that, in the model's process, also makes the
    continuous-batching configuration whose steps compile with the specontext backend.

    Args:
        options: backend options (checked by the caller before the process starts).
        engine: ``ContinuousBatchingConfig`` fields (:func:`engine_shapes` applied).
        **loader: ``ModelLoader``'s arguments (``device``, ``dtype``, ...).

    Attributes:
        cb_config: the configuration, None until a model loaded in this process.
    """

    def __init__(self, options: dict[str, Any], engine: dict[str, Any], **loader: Any):
        super().__init__(continuous_batching=True, **loader)
        self.options, self.engine = dict(options), dict(engine)
        self.cb_config = None

    def load_model_and_processor(self, model_id: str, on_progress=None):
        from .serving import continuous_batching_config

        _exit_cleanly_on_stop()
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        sample_per_request(model.generation_config)
        self.cb_config = continuous_batching_config(model, self.options, **self.engine)
        model.specontext_cb_config = self.cb_config  # engine_counts reads it
        logger.info("specontext serve: %s loaded; its continuous-batching steps compile with options %s", model_id,
                    self.options)
        return model, processor


class SpeContextGenerationState(GenerationState):
    """Hugging Face's generation state, always continuous batching, whose ``cb_config`` is
    the one :class:`SpeContextLoader` made in the model's process (None elsewhere).

    Args:
        loader: the server's :class:`SpeContextLoader`.
        **state: ``GenerationState``'s other arguments (``seed``, ``max_model_len``).
    """

    def __init__(self, loader: SpeContextLoader, **state: Any):
        self.loader = loader
        self.server_pid = os.getpid()  # the API server's process; the model's differs
        super().__init__(continuous_batching=True, **state)

    @property
    def cb_config(self):
        return self.loader.cb_config

    @cb_config.setter
    def cb_config(self, value) -> None:
        if value is not None:  # GenerationState.__init__ sets None; anything else would bypass the backend
            raise ValueError("specontext serve makes the continuous-batching configuration itself, in the model's "
                             "process; pass engine fields to build_server instead")

    def use_continuous_batching(self, config, processor) -> bool:
        if not super().use_continuous_batching(config, processor):
            raise ValueError(f"specontext serve serves text models with continuous batching; "
                             f"{type(config).__name__} is not one")
        if self.cb_config is None and os.getpid() != self.server_pid:  # the model's process, about to serve
            raise RuntimeError("specontext serve: the model's process has no specontext continuous-batching "
                               "configuration (its loader did not load the model in this process); refusing to "
                               "serve it dense")
        return True


def engine_counts(model, processor) -> dict[str, int]:
    """In the model's process (``EngineClient.submit``): the backend's path counters
    (:func:`~.serving.path_counts`) of every step the engine ran."""
    from .serving import path_counts

    return path_counts(model.specontext_cb_config)
