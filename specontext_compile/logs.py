"""The backend's names in PyTorch's logging (``TORCH_LOGS``, ``TORCH_TRACE``/``tlparse``).

Names:

- log ``specontext``: every logger of this package (``specontext_compile.*``, i.e. the
  backend and its passes); ``TORCH_LOGS=specontext`` shows INFO, ``+specontext`` DEBUG.
- artifact ``specontext_graphs``: each graph's FX code before and after the rewrite;
- artifact ``specontext_sites``: the per-site table (layer, phase, pattern, rewritten or why not).

Both artifacts are shown by ``TORCH_LOGS=<name>`` or with ``+specontext``. Independently of
``TORCH_LOGS``, with ``TORCH_TRACE=<dir>`` the backend writes structured artifacts
(:func:`trace_graph`, :func:`trace_sites`: ``specontext_graph_before``,
``specontext_graph_after`` as text, ``specontext_sites`` as JSON) into the trace next to
dynamo's and inductor's, so ``tlparse`` lists them per compiled graph. ``dump_dir`` (text and
DOT files, :mod:`specontext_compile.passes.dump`) is separate and unchanged.

When the names are registered, and why that is safe:

- torch parses ``TORCH_LOGS`` once, inside ``import torch`` (``torch._logging._init_logs()``),
  and raises ``ValueError`` ("Invalid log settings") for a name it does not know; there is no
  lazy lookup. So a name registered by this package's import comes too late:
  ``TORCH_LOGS=specontext python -c "import torch"`` fails before any of our code runs. The
  one hook torch runs before that parse is the ``torch.backends`` entry-point group (device
  backend autoload, run right before ``_init_logs``; torch's source says it is kept there "so
  backends can register their log names"). :func:`torch_autoload` is meant for that hook,
  through the tiny top-level module ``specontext_torch_logs`` (importing this package from
  inside ``import torch`` would pull in transformers and our ops). It registers nothing
  unless ``TORCH_LOGS`` names ``specontext``, one of our artifacts, or ``help``: without
  them, ``import torch`` is unchanged apart from reading that variable.
- :func:`register` runs when :mod:`specontext_compile.backend` is imported (explicitly, or
  by dynamo through the ``torch_dynamo_backends`` entry point). It always registers the two
  artifact names (entries in torch's name registry only, which ``getArtifactLogger`` needs;
  no logger, level or handler changes) and the log name only when ``TORCH_LOGS`` asks for
  it. Registering the *log* name hands our loggers to torch: its ``_init_logs`` (run again
  by ``torch._logging.set_logs``) sets ``propagate=False`` on registered loggers and adds
  its own handler, so records would no longer reach the root logger (``logging.basicConfig``,
  pytest's ``caplog``). Users who did not ask for torch's logging keep standard logging.
- Both are idempotent (a name already registered is left alone) and never call
  ``_init_logs``.

This module imports nothing from this package and torch only inside functions, so the
autoload module can load it by file location without importing the package.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["ARTIFACTS", "LOG_NAME", "artifact_logger", "register", "requested", "torch_autoload",
           "trace_graph", "trace_sites"]

LOG_NAME = "specontext"
PACKAGE = "specontext_compile"
GRAPHS = "specontext_graphs"
SITES = "specontext_sites"
ARTIFACTS = {
    GRAPHS: "Graph code before and after the specontext backend's sparse-attention rewrite",
    SITES: "Per-site table of the specontext backend: layer, phase, pattern, rewritten or why not",
}
TRACE_GRAPH_BEFORE = "specontext_graph_before"
TRACE_GRAPH_AFTER = "specontext_graph_after"
TRACE_SITES = "specontext_sites"


def requested(setting: str | None = None) -> bool:
    """Whether ``TORCH_LOGS`` (or ``setting``) names our log, one of our artifacts, or help."""
    setting = os.environ.get("TORCH_LOGS", "") if setting is None else setting
    names = {part.strip().lstrip("+-") for part in setting.strip("'\"").split(",")}
    return bool(names & {LOG_NAME, *ARTIFACTS, "help"})


def _register(log_name: bool) -> None:
    from torch._logging import _internal

    registry = _internal.log_registry
    if log_name and not registry.is_log(LOG_NAME):
        _internal.register_log(LOG_NAME, [PACKAGE])
    for name, description in ARTIFACTS.items():
        if not registry.is_artifact(name):
            _internal.register_artifact(name, description, visible=True)


def torch_autoload() -> None:
    """``torch.backends`` autoload hook (runs inside ``import torch``, before ``TORCH_LOGS`` is
    parsed): registers our names when ``TORCH_LOGS`` asks for them; otherwise does nothing."""
    if requested():
        _register(log_name=True)


def register() -> None:
    """At backend import: the artifact names always, the log name when ``TORCH_LOGS`` asks."""
    _register(log_name=requested())


def artifact_logger(module: str, artifact: str) -> logging.Logger:
    """torch's artifact logger ``<module>.__<artifact>`` (DEBUG records; shown by
    ``TORCH_LOGS=<artifact>`` or ``+specontext``; otherwise plain child of ``module``)."""
    import torch._logging

    register()
    return torch._logging.getArtifactLogger(module, artifact)


def _trace(name: str, encoding: str, payload_fn: Callable[[], Any]) -> None:
    import torch._logging

    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn)


def trace_graph(name: str, text_fn: Callable[[], str]) -> None:
    """A graph's text as a structured-trace artifact (``text_fn`` runs only under
    ``TORCH_TRACE``; call it before mutating the graph for a "before" snapshot)."""
    _trace(name, "string", text_fn)


def trace_sites(rows_fn: Callable[[], list[dict[str, Any]]]) -> None:
    """The per-site table as a JSON structured-trace artifact (``specontext_sites``)."""
    _trace(TRACE_SITES, "json", rows_fn)
