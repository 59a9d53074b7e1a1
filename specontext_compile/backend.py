"""The ``specontext`` dynamo backend: rewrite attention, then hand the graph on.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="specontext", options={...})`` works in a fresh interpreter.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch

from . import fallbacks, stack_room
from . import logs as _logs
from .config import MODES as _MODES
from .config import SpeContextConfig
from .freezing import drop_folded, fold_parameters
from .passes.dump import GraphDumper, graph_text
from .passes.gemv import rewrite_one_row_linears
from .passes.lower import LowerResult, lower_to_aten
from .passes.model_counts import add_model_counts
from .passes.sparse_rewrite import RewriteResult, SparseAttentionPass
from .regional import compile_regions
from .runtime import ops as _ops  # noqa: F401  (registers the specontext:: ops)
from .runtime import cpu_kernels, torch_private
from .runtime.aten_step import record_query
from .runtime.ops_store import CacheCapacityError
from .runtime.protocol import is_op
from .runtime.rollback import record_rows
from .runtime.static_state import model_stats
from .runtime.torch_private import counters

logger = logging.getLogger(__name__)
_graphs_log = _logs.artifact_logger(__name__, _logs.GRAPHS)  # TORCH_LOGS=specontext_graphs
_sites_log = _logs.artifact_logger(__name__, _logs.SITES)  # TORCH_LOGS=specontext_sites

__all__ = ["CompileReport", "clear_compile_reports", "compile_reports", "specontext_backend"]

_REPORTS: collections.deque = collections.deque(maxlen=64)


@dataclasses.dataclass
class CompileReport:
    """What the backend did to one graph dynamo handed it."""

    config: SpeContextConfig
    result: RewriteResult
    graph_module: torch.fx.GraphModule
    pass_uuid: str
    lowered: LowerResult | None = None  # set when the graph was lowered to aten (option lower, the default)

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


def _emit_graph(which: str, graph: torch.fx.Graph, header: str = "") -> None:
    """Graph code ``which`` ("before"/"after") the rewrite: the ``specontext_graphs`` artifact
    log and the ``specontext_graph_<which>`` trace artifact (each built only when enabled)."""
    if _graphs_log.isEnabledFor(logging.DEBUG):
        _graphs_log.debug("specontext: graph %s the rewrite:\n%s", which, header + graph_text(graph))
    _logs.trace_graph(f"specontext_graph_{which}", lambda: header + graph_text(graph))


def _site_rows(result: RewriteResult) -> list[dict[str, Any]]:
    """The per-site table: one row per attention site, in graph order."""
    return [{"layer": s.layer, "node": s.node.name, "phase": result.phase_label, "pattern": s.pattern,
             "q_len": s.q_len, "window": s.window, "rewritten": s.reason is None and bool(result.rewritten),
             "reason": s.reason} for s in result.sites]


def _log_result(result: RewriteResult) -> None:
    _logs.trace_sites(lambda: _site_rows(result))
    if _sites_log.isEnabledFor(logging.DEBUG):
        rows = _site_rows(result)
        _sites_log.debug("specontext: %d attention sites (%s)%s", len(rows), result.phase_label, "".join(
            f"\n  {RewriteResult.site_label(s):<40} {s.pattern:<10} "
            f"{'rewritten' if row['rewritten'] else 'dense: ' + str(row['reason'])}"
            for s, row in zip(result.sites, rows)))
    if not result.sites:
        logger.info("specontext: no attention site in this graph; passed through unchanged")
        return
    where = _graph_label(result)
    logger.info("specontext: %s, %d/%d attention sites rewritten (selection head %s, retrieval layers %s)",
                where, result.rewritten, result.total, result.selection_head, result.retrieval_layers)
    for site in result.sites:
        if site.reason:
            logger.info("specontext: %s, site of %s stays dense: %s", where, RewriteResult.site_label(site),
                        site.reason)


def _graph_label(result: RewriteResult) -> str:
    """"decode graph", "prefill graph", "graph without attention", ..."""
    return f"{result.phase} graph" if result.phase != "none" else result.phase_label


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
    fallbacks.watch_recompile_limit()  # never silently uncompiled (fallbacks.py)
    fallbacks.note_frame()
    mode = config.compile.mode or mode or "default"
    if mode not in _MODES:
        raise ValueError(f"specontext: unknown compile mode {mode!r}; valid modes are {_MODES}")
    rewrite = SparseAttentionPass.from_config(config)
    dumper = GraphDumper.from_option(config.debug.dump_dir)
    before = dumper.snapshot(gm.graph) if dumper is not None else None
    _emit_graph("before", gm.graph)
    gm, adopted = _adopt_static_cache(gm, example_inputs, config)
    stateful = adopted if adopted is not None and adopted.state is not None else None
    result = rewrite(gm.graph)
    extra = _ExtraInputs(stateful, _owner(example_inputs) if result.rewritten else None)
    if extra.owner_index is not None:
        if stateful is None:
            gm = _copy(gm)  # a new graph input: dynamo's own graph must keep its placeholders
        if not add_model_counts(gm.graph):
            extra.owner_index = None
    _warn_if_dense_cache(result, adopted, gm.graph)
    pass_uuid = rewrite.uuid()
    if config.offload.device_memory_bytes is not None and result.rewritten:  # KV offload (issue 5)
        from .passes.schedule import OffloadSchedulePass

        schedule = OffloadSchedulePass(config.buffer_tokens, _copy_bandwidth(config, example_inputs))
        gm.meta["specontext_offload_schedule"] = schedule(gm.graph)
        pass_uuid = f"{pass_uuid}+{schedule.uuid()}"
    if dumper is not None:
        dumper.write(before, gm.graph, result.phase, f"# pass {pass_uuid}\n")
    _emit_graph("after", gm.graph, f"# pass {pass_uuid} ({result.phase_label})\n")
    gm.recompile()
    counters["specontext"]["graphs"] += 1
    counters["specontext"]["sites_total"] += result.total
    counters["specontext"]["sites_rewritten"] += result.rewritten
    _REPORTS.append(CompileReport(config, result, gm, pass_uuid))
    _log_result(result)
    fallbacks.warn_dense_decode(result, _graph_label(result), _writes_store(gm.graph))
    inner = config.compile.inner
    if inner == "auto":  # a graph with KV offload compiles too: its ops move rows, the step code is ours
        inner = "inductor" if result.rewritten else "eager"
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    gm = _copy(gm)  # the report keeps the rewritten graph with our ops; lowering edits a copy
    if inner == "eager" or callable(inner):  # the same lowered step, run by the graph module's Python
        if mode != "default":
            logger.info("specontext: mode %r applies to graphs compiled by inductor; this %s runs "
                        "eager", mode, _graph_label(result))
        _lower(gm, config, on_cuda, fuse=False)
        runner = inner(gm) if callable(inner) else gm.forward  # a runner: e.g. the recall probe
        return stack_room.with_stack_room(extra.wrap(runner))
    if config.compile.gemv if config.compile.gemv is not None else not on_cuda:
        counters["specontext"]["one_row_linears"] += rewrite_one_row_linears(gm.graph)
    unlowered = _copy(gm) if _may_take_kernel(on_cuda) else None  # for a lowering without the kernel
    _lower(gm, config, on_cuda)
    example_inputs = [*example_inputs, *extra.example_inputs(example_inputs)]
    patches = {**inductor_patches(config, mode, example_inputs), **_cache_key_patch(pass_uuid),
               **_cacheable_functions(gm.graph, pass_uuid)}
    mark_added_inputs(gm)
    keep = None
    if _folds_parameters(config, on_cuda):
        example_inputs, keep = fold_parameters(gm, example_inputs)
        counters["specontext"]["frozen_graphs"] += 1
    try:
        compiled = _inductor(gm, example_inputs, patches, config, on_cuda)
    except Exception as err:  # noqa: BLE001 - re-raised unless it is our kernel's and can be left out
        first = _REPORTS[-1].lowered
        if unlowered is None or first is None or not first.kernel or not _names_our_kernel(err):
            raise
        _lower(unlowered, config, on_cuda, kernel=False)
        mark_added_inputs(unlowered)
        compiled = _inductor(unlowered, example_inputs, patches, config, on_cuda)
        _warn_kernel_fallback(err, first, _graph_label(result))
    if keep is not None:
        compiled = drop_folded(compiled, keep)
    return stack_room.with_stack_room(extra.wrap(_checked_backward(compiled)))  # its Python off chunk boundaries


#: our Triton kernels' names (codegen/kernels.py), as inductor's compile errors name them
_OUR_KERNELS = ("sparse_decode_split_kernel", "sparse_mla_split_kernel", "sparse_decode_merge_kernel")


def _names_our_kernel(err: BaseException) -> bool:
    """Whether a compile error (or one it was raised from) names one of our generated kernels:
    only then is compiling without them a remedy."""
    while err is not None:
        if any(name in str(err) for name in _OUR_KERNELS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _may_take_kernel(on_cuda: bool) -> bool:
    """Whether the lowering may send sites to the generated kernel (CUDA graphs only)."""
    return on_cuda


def _inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], patches: dict, config: SpeContextConfig,
              on_cuda: bool):
    """Inductor's compile of the lowered graph: by regions (each distinct decoder layer once)
    when option ``regional`` says so, else whole. (Decode products are fused reductions on CPU
    because the lowering set the variants' ``fused_products``: no trace-time flag.)"""
    compile_fx = torch_private.compile_fx
    if _regional(config, on_cuda):
        regional = {**patches, "freezing": False}  # weights stay inputs, shared by the layers
        compiled = compile_regions(gm, lambda graph, inputs: compile_fx(graph, inputs, config_patches=regional),
                                   example_inputs, lift=_LAYER_SLOTS)
        if compiled is not None:
            return compiled
    return compile_fx(gm, example_inputs, config_patches=patches)


def _warn_kernel_fallback(err: Exception, first: LowerResult, label: str) -> None:
    """Inductor could not compile the generated attention kernel inside this graph (a
    torch/triton pair it was not verified with), and the graph, lowered again with those
    sites on the torch body, compiled with inductor's own kernels (exact, slower on long
    contexts). Logged with the error's cause (the whole error at DEBUG) and counted:
    ``kernel_compile_fallbacks`` up, the first lowering's sites and ops taken back."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    causes = [line for line in lines if re.search(r"\w+(Error|Exception)\b", line)]
    cause = " / ".join(dict.fromkeys([lines[0] if lines else "", *(causes[-1:])]))[:400]
    logger.warning("specontext: inductor could not compile the generated attention kernel in the %s "
                   "(%s: %s); its %d kernel sites use inductor's own kernels instead (exact). "
                   "kernel='torch' skips the attempt; please report the error with your torch and "
                   "triton versions (whole error at DEBUG: TORCH_LOGS=+specontext)", label,
                   type(err).__name__, cause, first.kernel)
    logger.debug("specontext: the generated kernel's compile error", exc_info=err)
    counters["specontext"]["kernel_compile_fallbacks"] += 1
    counters["specontext"]["kernel_sites_lowered"] -= first.kernel
    counters["specontext"]["ops_lowered"] -= sum(first.lowered.values())  # the second lowering counted them


def _lower(gm: torch.fx.GraphModule, config: SpeContextConfig, on_cuda: bool, fuse: bool = True,
           kernel: bool = True) -> None:
    """Our ops swapped for their aten bodies (option ``lower``; ``passes/lower.py``), for
    inductor and for ``inner="eager"`` alike: both run the same functions (``fuse=False`` for
    eager: a refined site's refinement and attention stay two calls, each observable, with
    the same kept set and logits as the fused body). ``lower=False`` keeps the ops opaque
    (their Python bodies: counters). ``kernel=False``: no site goes to the generated kernel
    (the fallback when inductor cannot compile it)."""
    if config.compile.lower:
        lowered = lower_to_aten(gm.graph, check_capacity=not on_cuda, fuse=fuse,
                                kernel_device=_may_take_kernel(on_cuda), no_kernel=not kernel)
        counters["specontext"]["ops_lowered"] += sum(lowered.lowered.values())
        counters["specontext"]["kernel_sites_lowered"] += lowered.kernel  # CUDA: the generated kernel (kernel_step)
        _REPORTS[-1].lowered = lowered
    gm.recompile()


# calls whose int argument differs by layer (the lagged query's slot): a tensor in regional graphs
_LAYER_SLOTS = {record_query: 3, record_rows: 3}


def _regional(config: SpeContextConfig, on_cuda: bool) -> bool:
    """Regional compilation (``regional.py``): option ``regional``; None = on for CPU graphs
    unless weight freezing was asked for (a frozen region is not shared). The compile mode's
    settings apply to each region (CUDA graphs, the one that would not, are CUDA-only)."""
    if config.compile.regional is not None:
        return config.compile.regional
    return not on_cuda and config.compile.freezing is not True


def _folds_parameters(config: SpeContextConfig, on_cuda: bool) -> bool:
    """Whether the graph's parameters are folded in before inductor compiles it
    (:mod:`.freezing`): option ``freezing=True`` asked for, a CPU graph compiled whole (a region
    is shared by the layers: its weights stay inputs), gradients off (inductor freezes only
    then). ``freezing=None`` keeps the parameters as inputs (inductor's freezing patch then
    changes nothing: docs/benchmarks.md, "Freezing that takes effect")."""
    return (config.compile.freezing is True and not on_cuda and not _regional(config, on_cuda)
            and not torch.is_grad_enabled())


def _adopt_static_cache(gm: torch.fx.GraphModule, example_inputs: list[Any], config: SpeContextConfig):
    """Hugging Face's ``StaticCache`` as a KV store (``passes/static_cache.py``); not with KV
    offload, which needs ``SpeContextCache``'s host tier."""
    from .passes.static_cache import AdoptedStaticCache, adopt_static_cache, has_static_cache_writes

    if not has_static_cache_writes(gm.graph):
        return gm, None
    if config.offload.device_memory_bytes is not None:
        logger.warning("specontext: KV offload (device_memory_bytes) needs specontext_compile.SpeContextCache "
                       "(its host tier); this graph writes Hugging Face's StaticCache, so attention stays dense")
        return gm, AdoptedStaticCache(reason="KV offload needs SpeContextCache")
    gm = _copy(gm)  # new graph inputs: dynamo's own graph must keep its placeholders
    adopted = adopt_static_cache(gm, example_inputs)
    if adopted is not None and adopted.reason is not None:
        logger.info("specontext: StaticCache adopted without a selection: %s", adopted.reason)
    return gm, adopted


_DENSE_CACHE_WARNED = False


def _warn_if_dense_cache(result: RewriteResult, adopted, graph: torch.fx.Graph) -> None:
    """One WARNING per process when attention reads no store we can make sparse (Hugging
    Face's ``DynamicCache``, or no cache): name the two ways to get sparsity. Not when the
    graph writes one of our stores (the sites then have reasons of their own:
    :func:`fallbacks.warn_dense_decode`)."""
    global _DENSE_CACHE_WARNED
    if _DENSE_CACHE_WARNED or not result.sites or adopted is not None:
        return
    if any(s.write is not None for s in result.sites) or _writes_store(graph):
        return
    _DENSE_CACHE_WARNED = True
    if _in_continuous_batching():
        logger.warning(
            "specontext: %d attention site(s) read Hugging Face's paged continuous-batching cache, which the "
            "backend makes sparse only through specontext_compile.continuous_batching_config(model, options, "
            "...): pass that as continuous_batching_config= instead of a ContinuousBatchingConfig whose "
            "varlen_compile_config names the specontext backend; these steps run dense (exact).", len(result.sites))
        return
    logger.warning(
        "specontext: %d attention site(s) read no KV store the backend can make sparse (Hugging Face's "
        "DynamicCache, or no cache), so they run dense. For sparse decoding, either generate with "
        "cache_implementation=\"static\" (Hugging Face's StaticCache) or pass a "
        "specontext_compile.SpeContextCache as past_key_values (specontext_compile.compile(model) does it).",
        len(result.sites))


def _in_continuous_batching() -> bool:
    """Whether this compile runs under Hugging Face's continuous-batching engine (a frame of
    ``transformers.generation.continuous_batching`` on the stack): its paged cache's update
    breaks dynamo's graph there, so the attention graph itself carries no sign of it."""
    return any("continuous_batching" in frame.f_code.co_filename for frame, _ in traceback.walk_stack(None))


def _owner(example_inputs: list[Any]) -> int | None:
    """Index of the first parameter among the inputs (the model's identity at call time:
    dynamo may run one compiled graph for several models of the same code)."""
    return next((i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)), None)


@dataclasses.dataclass
class _ExtraInputs:
    """The inputs the backend appends to dynamo's on every call of a graph: an adopted
    StaticCache's retrieval state (that cache's: ``passes/static_cache.py``), then the
    model's counters (``passes/model_counts.py``; the model whose parameter is input
    ``owner_index``). Dynamo calls a backend's result with positional inputs."""

    adopted: Any = None  # AdoptedStaticCache with a state, or None
    owner_index: int | None = None

    def inputs(self, args) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``(extra inputs, the adopted cache's state or None)`` for one call."""
        extra, state = (), None
        if self.adopted is not None:
            state = self.adopted.state_for_call(args)
            extra = state.tensors()
        if self.owner_index is not None:
            owner = args[self.owner_index]
            extra = (*extra, model_stats(owner, owner.device))
        return extra, state

    def example_inputs(self, args) -> tuple:
        """The extra inputs for compiling: an adopted state's fake values (their batch is the
        graph's, symbolic when dynamo made it so: the compiled graph serves every batch)."""
        extra = self.inputs(args)[0]
        if self.adopted is not None and self.adopted.example_values:
            extra = (*self.adopted.example_values, *extra[len(self.adopted.example_values):])
        return extra

    def wrap(self, fn: Callable) -> Callable:
        if self.adopted is None and self.owner_index is None:
            return fn

        def call(*args):
            extra, state = self.inputs(args)
            try:
                out = fn(*args, *extra)
            except CacheCapacityError as error:
                if self.adopted is None:
                    raise
                raise CacheCapacityError(_static_cache_full(error)) from error
            if state is not None:
                self.adopted.bind(out, state)
            return out

        return call


BACKWARD_SUPPORT = (
    "backward through a compiled specontext step whose saved inputs a later step changed in place "
    "(the KV store and its length are written in place by every step, as in Hugging Face's StaticCache). "
    "Backward works through the latest step of a cache only: call backward (or detach) before the next "
    "step, or, for a loss over several steps, run them uncompiled with a DynamicCache")


def _static_cache_full(error: Exception) -> str:
    """The capacity error of an adopted graph, naming the cache the caller passed."""
    detail = str(error).split(":", 1)[-1].split(". ", 1)[0].strip()  # "{length} + {q_len} tokens > capacity {C}"
    return (f"Hugging Face's StaticCache is full: {detail}. Create it with a larger max_cache_len "
            "(StaticCache(config=..., max_cache_len=...), or generate(..., max_length=...) with "
            "cache_implementation=\"static\").")


def _checked_backward(fn: Callable) -> Callable:
    """``fn`` whose tensors saved for backward (with gradients enabled) are checked when
    backward reads them: one a later step wrote in place raises :data:`BACKWARD_SUPPORT`
    instead of autograd's bare version-counter error. Free under ``torch.no_grad()``."""

    def pack(tensor: torch.Tensor):
        return tensor, tensor._version

    def unpack(packed) -> torch.Tensor:
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError(f"specontext: {BACKWARD_SUPPORT}")
        return tensor

    def call(*args):
        if not torch.is_grad_enabled():
            return fn(*args)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args)

    return call


def _writes_store(graph: torch.fx.Graph) -> bool:
    """Whether the graph writes a KV store the pass can make sparse (``specontext::kv_write``)."""
    return any(is_op(n, torch.ops.specontext.kv_write) for n in graph.nodes)


def _copy_bandwidth(config: SpeContextConfig, example_inputs: list[Any]) -> float:
    """The offload schedule's copy bandwidth (bytes/s): the option, else this machine's
    calibration (measured once, kept on disk: ``runtime/calibration.py``)."""
    if config.offload.copy_bandwidth is not None:
        return config.offload.copy_bandwidth
    from .runtime.calibration import copy_bandwidth

    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return copy_bandwidth("cuda" if on_cuda else "cpu")


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (nodes and their meta), same submodules,
    with what AOTAutograd reads from a dynamo graph (``_param_name_to_source``, each
    placeholder's ``_dynamo_source``): without them it does not see which inputs keep their
    address, and CUDA graphs skip every graph that writes the KV stores."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, copies)
    graph.output(out)
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    for node, copy in copies.items():
        if hasattr(node, "_dynamo_source"):
            copy._dynamo_source = node._dynamo_source
    return copied


def mark_added_inputs(gm: torch.fx.GraphModule) -> None:
    """Give the inputs our passes added (a model's path counters, an adopted StaticCache's
    retrieval state, paged state: tensors allocated once and written in place) what dynamo
    gives its own: no source, and an address that stays (``mark_static_address``), so CUDA
    graphs read and write them in place instead of skipping the graph."""
    if not hasattr(gm, "_param_name_to_source"):
        return
    for node in gm.graph.find_nodes(op="placeholder"):
        if not hasattr(node, "_dynamo_source"):
            node._dynamo_source = None
            node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"


class _SourcesKey(torch_private.custom_graph_pass()[0]):
    """A post-grad pass that changes nothing and carries our pass's ``uuid`` (a hash of the
    passes' and runtime's sources and of the options) into inductor's cache keys: an FX graph
    or AOTAutograd cache entry compiled by another version of our code is never reused. Seen
    without it: after an op's schema changed, a cached step called it with its old arguments."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


def _cache_key_patch(pass_uuid: str) -> dict[str, Any]:
    """``post_grad_custom_post_pass`` = :class:`_SourcesKey` unless the caller set one (then
    theirs stays, logged: our sources' hash is then not in inductor's keys)."""
    inductor_config = torch_private.inductor_config()
    if inductor_config.post_grad_custom_post_pass is not None:
        logger.info("specontext: inductor's post_grad_custom_post_pass is set by the caller; inductor's caches "
                    "do not key on this version of specontext's sources")
        return {}
    return {"post_grad_custom_post_pass": _SourcesKey(pass_uuid)}


def _cacheable_functions(graph: torch.fx.Graph, pass_uuid: str) -> dict[str, Any]:
    """``unsafe_marked_cacheable_functions`` naming the package's functions that ``graph`` calls
    (the lowered step's aten bodies, ``one_row_linear``), each keyed by ``pass_uuid``.

    AOTAutograd's cache refuses a graph calling a plain Python function it does not know, so
    every region of a new process was traced by AOTAutograd again (about half of a restart's
    first step). These functions are pure functions of their inputs, traced into aten ops, and
    ``pass_uuid`` hashes their sources and the options, and the key also takes the module
    flags read while they are traced (``sparse_attention.FUSED_PRODUCT_ROWS``,
    ``REALIZE_ROWS``): a change of any changes the key. A function replaced at run time (a
    monkeypatch) is not seen: clear torch's caches, or use another ``TORCHINDUCTOR_CACHE_DIR``.
    Functions the caller already marked keep their entries."""
    from .runtime import sparse_attention

    inductor_config = torch_private.inductor_config()

    names = {f"{node.target.__module__}.{node.target.__name__}" for node in graph.nodes
             if node.op == "call_function" and not isinstance(node.target, torch_private.OpOverload)
             and getattr(node.target, "__module__", "").startswith(f"{__package__}.")}
    if not names:
        return {}
    key = f"{pass_uuid}:{sparse_attention.FUSED_PRODUCT_ROWS}:{sparse_attention.REALIZE_ROWS}"
    marked = {name: key for name in sorted(names)}
    return {"unsafe_marked_cacheable_functions": {**marked, **inductor_config.unsafe_marked_cacheable_functions}}


def inductor_patches(config: SpeContextConfig, mode: str, example_inputs: list[Any]) -> dict[str, Any]:
    """Inductor settings for one graph: those of ``torch.compile``'s ``mode`` (``"reduce-overhead"``:
    CUDA graphs, which inductor applies only to graphs on CUDA devices), plus weight freezing
    (``config.compile.freezing``; on CPU it pre-packs the weights of linear layers for oneDNN) — freezing
    takes effect only when the graph is compiled with gradients off (``torch.no_grad()``, as
    ``generate`` runs)."""
    patches: dict[str, Any] = {}
    if mode != "default":
        patches.update(torch_private.mode_options(mode))
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    freezing = config.compile.freezing if config.compile.freezing is not None else not on_cuda
    if freezing:
        patches["freezing"] = True
    if not on_cuda and cpu_kernels.available():
        # Inductor proves each vector ISA it may use by building a probe library and loading it in
        # a new Python process, at every process's first CPU compile (about 1.2 s of a warm
        # restart's first step here, issue 51). Our kernels just built with -march=native with
        # the same compiler (``CXX`` or g++), and inductor still keeps only the ISAs the CPU's
        # flags list: the probe cannot fail where they built.
        patches["cpp.vec_isa_ok"] = True
    return patches
