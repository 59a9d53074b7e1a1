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

from .config import MODES as _MODES
from .config import SpeContextConfig
from .passes.dump import GraphDumper
from .passes.gemv import rewrite_one_row_linears
from .passes.lower import LowerResult, lower_to_aten
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
    lowered: LowerResult | None = None  # set when the graph was lowered to aten (inner="inductor")

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
        mode: ``torch.compile``'s mode (Hugging Face's ``CompileConfig`` passes
            ``"reduce-overhead"`` by default); the option ``mode`` overrides it. It applies to
            the graphs inductor compiles (see :func:`inductor_patches`): decode graphs with
            ``inner="auto"``, every graph with ``inner="inductor"``.

    Raises:
        ValueError: for unknown options or bad values.
    """
    config = SpeContextConfig.from_options(options)
    mode = config.mode or mode or "default"
    if mode not in _MODES:
        raise ValueError(f"specontext: unknown compile mode {mode!r}; valid modes are {_MODES}")
    rewrite = SparseAttentionPass(
        config.budget, config.sink_tokens, config.recent_window,
        config.retrieval_layers, config.max_sparse_q_len, config.kernel, config.retrieval_head,
        config.dense_shortcut, config.candidates, config.min_coverage,
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
    inner = config.inner
    if inner == "auto":  # offload stays on the eager op chain (its ops keep state outside the graph)
        offload = "specontext_offload_schedule" in gm.meta
        inner = "inductor" if result.rewritten and not offload else "eager"
    if inner == "eager":
        if mode != "default":
            logger.info("specontext: mode %r applies to graphs compiled by inductor; this %s graph runs "
                        "eager", mode, result.phase)
        return gm.forward
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    gm = _copy(gm)  # the report keeps the rewritten graph with our ops; lowering edits a copy
    if config.gemv if config.gemv is not None else not on_cuda:
        counters["specontext"]["one_row_linears"] += rewrite_one_row_linears(gm.graph)
    if config.lower:
        lowered = lower_to_aten(gm.graph, check_capacity=not on_cuda)
        counters["specontext"]["ops_lowered"] += sum(lowered.lowered.values())
        _REPORTS[-1].lowered = lowered
    gm.recompile()
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_patches(config, mode, example_inputs))


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (nodes and their meta), same submodules."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def inductor_patches(config: SpeContextConfig, mode: str, example_inputs: list[Any]) -> dict[str, Any]:
    """Inductor settings for one graph: those of ``torch.compile``'s ``mode`` (``"reduce-overhead"``:
    CUDA graphs, which inductor applies only to graphs on CUDA devices), plus weight freezing
    (``config.freezing``; on CPU it pre-packs the weights of linear layers for oneDNN) — freezing
    takes effect only when the graph is compiled with gradients off (``torch.no_grad()``, as
    ``generate`` runs)."""
    patches: dict[str, Any] = {}
    if mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    freezing = config.freezing if config.freezing is not None else not on_cuda
    if freezing:
        patches["freezing"] = True
    return patches
