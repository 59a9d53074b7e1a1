"""The ``specontext`` dynamo backend: rewrite attention, then hand the graph on.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="specontext", options={...})`` works in a fresh interpreter.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from .config import SpeContextConfig
from .passes.dump import GraphDumper
from .passes.sparse_rewrite import RewriteResult, SparseAttentionPass
from .runtime import ops as _ops  # noqa: F401  (registers the specontext:: ops)

logger = logging.getLogger(__name__)

__all__ = ["CompileReport", "clear_compile_reports", "compile_reports", "specontext_backend"]

_REPORTS: collections.deque = collections.deque(maxlen=64)


@dataclasses.dataclass
class CompileReport:
    """What the backend did to one graph dynamo handed it."""

    config: SpeContextConfig
    result: RewriteResult
    graph_module: torch.fx.GraphModule
    pass_uuid: str

    @property
    def sites_total(self) -> int:
        return self.result.total

    @property
    def sites_rewritten(self) -> int:
        return self.result.rewritten


def compile_reports() -> list[CompileReport]:
    """Reports of the most recent graphs compiled in this process (oldest first, <= 64)."""
    return list(_REPORTS)


def clear_compile_reports() -> None:
    """Forget the reports kept by :func:`compile_reports`."""
    _REPORTS.clear()


def _log_result(result: RewriteResult) -> None:
    if not result.sites:
        logger.info("specontext: no attention site in this graph; passed through unchanged")
        return
    logger.info(
        "specontext: %s graph, %d/%d attention sites rewritten (selection head %s, retrieval layers %s)",
        result.phase, result.rewritten, result.total, result.selection_head, result.retrieval_layers,
    )
    for layer, reason in result.fallbacks():
        logger.info("specontext: site of layer %s stays dense: %s", layer, reason)


def specontext_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """Dynamo backend entry.

    Args:
        gm: the graph dynamo captured.
        example_inputs: its example inputs.
        options: see :class:`~specontext_compile.config.SpeContextConfig`.
        mode: accepted for HF ``CompileConfig`` compatibility (its default is
            ``"reduce-overhead"``); ignored with a warning, since CUDA graphs do not apply.

    Raises:
        ValueError: for unknown options or bad values.
    """
    config = SpeContextConfig.from_options(options)
    if mode not in (None, "default"):
        logger.warning("specontext: compile mode %r is ignored", mode)
    rewrite = SparseAttentionPass(
        config.budget, config.sink_tokens, config.recent_window,
        config.retrieval_layers, config.max_sparse_q_len, config.kernel, config.retrieval_head,
    )
    dumper = GraphDumper.from_option(config.dump_dir)
    before = dumper.snapshot(gm.graph) if dumper is not None else None
    result = rewrite(gm.graph)
    if config.device_memory_bytes is not None and result.rewritten:  # KV offload (issue 5)
        from .passes.schedule import OffloadSchedulePass

        gm.meta["specontext_offload_schedule"] = OffloadSchedulePass(config.budget)(gm.graph)
    if dumper is not None:
        dumper.write(before, gm.graph, result.phase, f"# pass {rewrite.uuid()}\n")
    gm.recompile()
    counters["specontext"]["graphs"] += 1
    counters["specontext"]["sites_total"] += result.total
    counters["specontext"]["sites_rewritten"] += result.rewritten
    _REPORTS.append(CompileReport(config, result, gm, rewrite.uuid()))
    _log_result(result)
    if config.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    return gm.forward
