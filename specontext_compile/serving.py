"""Sparse decoding inside Hugging Face's continuous batching (issue 28).

One call builds the engine's configuration with the backend as its compiler::

    cb = specontext_compile.continuous_batching_config(model, {"budget": 512}, max_batch_tokens=256)
    outputs = model.generate_batch(inputs=[ids_a, ids_b, ...], generation_config=gen,
                                   continuous_batching_config=cb)
    specontext_compile.serving.path_counts(cb)   # {"sparse_steps": ..., "dense_steps": ...}

Every step of the engine then runs as one compiled graph (``passes/paged.py`` rewrites it,
``runtime/paged.py`` has its functions): a step whose requests all decode attends sparsely,
each request to its own selection (sinks, recent window, lagged-query top-k: the one-request
step's selection) over the paged cache; prefill and chunked prefill attend densely and
exactly, as Hugging Face does, and in a step that mixes them, decoding requests still
attend sparsely. With option ``candidates`` > 1 (the two-stage selection) or the page rescue
(option ``page_rescue``, on by default) each layer keeps its own ``budget`` of the step's
candidates by its own scores, as the one-request step does; the rescue first adds the tokens
of the request's pages with the highest Quest bound under the layer's query
(``runtime/paged_bounds.py``: per-page key bounds kept per physical page of the cache).
The lagged queries live in the cache's blocks and the bounds in its pages, so requests
joining, finishing and reusing blocks need nothing from us.

What it changes outside the package, and why: Hugging Face excludes the paged cache's update
from compilation (``@torch.compiler.disable`` on ``PagedAttentionCache.update``), so a
compiled step would never see the KV write and the gather it must rewrite.
:func:`continuous_batching_config` makes that method traceable (its undecorated function:
the same code) for the process, logged once.

Not built yet (issue 28): draft heads, sliding-window layers (refused), per-layer rescue
sets (``rescue_layers``), the fidelity guard, KV offload, CUDA graphs; the page rescue needs
the engine's ``page_size`` to be a multiple of 16 (else the step selects without it, logged). A one-token chunk of a chunked prefill looks like a decode row in
the mask; the step function tells them apart from the engine's ``logits_to_keep``
(:func:`~.runtime.paged.decoding_rows`) and runs it as prefill.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from .backend import _copy
from .config import SpeContextConfig, flatten_options
from .passes.paged import PagedRewrite, rewrite_paged
from .runtime.page_bounds import PAGE_TOKENS
from .runtime.paged import (
    DENSE,
    MIXED,
    PAGED_STATS,
    SPARSE,
    PagedState,
    classify_step,
    decoding_rows,
    mask_rows,
    record_generated,
)
from .runtime.torch_private import recompile_limit, set_recompile_limit

logger = logging.getLogger(__name__)

__all__ = ["PagedBackend", "check_options", "continuous_batching_config", "path_counts", "state_bytes"]


class PagedBackend:
    """A ``torch.compile`` backend for the steps of Hugging Face's continuous batching.

    ``states``: one :class:`~.runtime.paged.PagedState` per live paged cache (keyed by its
    layer-0 key view), so two engines on one model never read each other's lagged queries.
    ``rewrites``: what the pass did to each graph (:class:`~.passes.paged.PagedRewrite`).
    Hugging Face deep-copies its configuration: the backend is held by a plain function
    (:func:`continuous_batching_config`), which a deep copy keeps as is.
    """

    def __init__(self, options: dict[str, Any] | None = None, decode_rows: int | None = None):
        self.config = SpeContextConfig.from_options(options)
        self.decode_rows = decode_rows  # at most this many decode rows per step (the engine's requests)
        _check_built(self.config, options or {})
        self.states: dict[int, PagedState] = {}
        self.retired = dict.fromkeys(PAGED_STATS, 0)  # counters of caches already freed
        self.peak_state_bytes = 0  # the most bytes of state (PagedState) live at once
        self.warned_rescue = False  # the page rescue's absence is logged once
        _BACKENDS.add(self)  # the engine's block copies reach this backend's states (_copy_state_with_blocks)
        self.rewrites: list[PagedRewrite] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
        # three variants of the step (new graph inputs: dynamo's own graph keeps its placeholders)
        variants = {kind: _copy(gm) for kind in (SPARSE, MIXED, DENSE)}
        result = rewrite_paged(variants[SPARSE].graph, self.config, SPARSE)
        self.rewrites.append(result)
        if not result.rewritten:
            logger.info("specontext: continuous-batching graph left dense (exact): %s", result.reason)
            return self._compile(gm, list(example_inputs))
        for kind in (MIXED, DENSE):
            rewrite_paged(variants[kind].graph, self.config, kind, self.decode_rows)
        logger.info("specontext: continuous-batching step rewritten: %d sites over a paged cache (page size %d, "
                    "%d blocks), retrieval layers %s", len(result.sites), result.layout.page_size,
                    result.layout.blocks, list(result.retrieval_layers))
        if self.config.selection.page_rescue and not result.spec.rescue_pages and not self.warned_rescue:
            self.warned_rescue = True
            logger.warning("specontext: the continuous-batching step selects without the page rescue: its pages of "
                           "%d tokens do not divide the engine's page_size %d, so tokens will differ from "
                           "specontext_compile.compile with the same options (set page_size to a multiple of %d)",
                           PAGE_TOKENS, result.layout.page_size, PAGE_TOKENS)
        tells = min(result.keep_input, result.read_input, result.write_input) >= 0
        if not tells:
            logger.warning("specontext: this continuous-batching graph has no logits_to_keep (or its read/write "
                           "indices are not inputs): a one-token prefill chunk cannot be told from a decode token "
                           "and is attended sparsely (docs/serving.md, 'Not built yet')")
        mask = example_inputs[result.mask_input]
        no_chunk = torch.zeros(mask.shape[2], dtype=torch.bool, device=mask.device)
        inputs = [*example_inputs, *self._state(result, example_inputs[result.key_input]).tensors(), no_chunk]
        steps = {kind: self._compile(g, inputs) for kind, g in variants.items()}
        stride = result.layout.stride

        def step(*args):
            state = self._state(result, args[result.key_input])
            mask = args[result.mask_input]
            read = args[result.read_input] if tells else None
            rows = mask_rows(mask)  # what each query row is, read from the mask once per step
            decode, chunk = decoding_rows(mask, read, state.generated if tells else None, stride, rows)
            kind, decoding = classify_step(mask, decode, rows)  # one host read per step
            if kind == MIXED and self.decode_rows is not None and decoding > self.decode_rows:
                raise RuntimeError(f"a continuous-batching step has {decoding} decoding requests, more than the "
                                   f"engine's max_requests_per_batch={self.decode_rows} the step was built for")
            if tells:  # after reading it: this step's rows are the next step's previous tokens
                record_generated(state.generated, mask, args[result.write_input], args[result.keep_input], stride,
                                 rows)
                state.stats[PAGED_STATS.index("one_token_chunks")] += chunk.sum()
            return steps[kind](*args, *state.tensors(), chunk)

        return step

    def _state(self, result: PagedRewrite, key_view: torch.Tensor) -> PagedState:
        """The state of the cache whose layer-0 key view is ``key_view`` (Hugging Face keeps one
        view object per cache and layer). Dropped with the view: a later cache allocated at
        the same address never finds a finished engine's lagged queries."""
        key = id(key_view)
        state = self.states.get(key)
        if state is None:
            state = PagedState.allocate(len(result.retrieval_layers), result.layout.blocks, result.num_heads,
                                        result.head_dim, key_view.device)
            state.stride = result.layout.stride
            if result.spec.rescue_pages:
                state.allocate_bounds(len(result.sites), result.layout.pages(result.spec.page_tokens), key_view)
                state.pages_per_block = result.layout.page_size // result.spec.page_tokens
            self.states[key] = state
            live = sum(s.nbytes for s in self.states.values())
            self.peak_state_bytes = max(self.peak_state_bytes, live)
            weakref.finalize(key_view, self._retire, key)
        return state

    def _retire(self, key: int) -> None:
        """A cache is gone: keep its counters, drop its state."""
        state = self.states.pop(key, None)
        if state is not None:
            for name, value in state.counts().items():
                self.retired[name] += value

    def counts(self) -> dict[str, int]:
        """:data:`~.runtime.paged.PAGED_STATS` summed over every cache this backend stepped."""
        total = dict(self.retired)
        for state in list(self.states.values()):
            for name, value in state.counts().items():
                total[name] += value
        return total

    def _compile(self, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        """``inner="inductor"`` compiles the step with inductor; ``"auto"`` and ``"eager"`` run
        the graph module's Python. Not inductor by default: the engine's per-layer cache views
        are aliasing views of one tensor, each written in place, and a step compiled whole
        was far slower than the same step run eagerly (docs/serving.md, "The step runs eagerly
        by default")."""
        gm.recompile()
        inner = self.config.compile.inner
        if inner != "inductor":
            return inner(gm) if callable(inner) else gm.forward
        from .backend import mark_added_inputs
        from .runtime.torch_private import compile_fx

        mark_added_inputs(gm)  # the paged state's placeholders: AOTAutograd asks every input's source
        return compile_fx(gm, inputs)


#: options whose non-default values this step does not build yet: refused, naming the option
_NOT_BUILT = {
    "retrieval_head": "draft heads", "min_coverage": "the fidelity guard",
    "dense_layers": "dense layers", "rescue_layers": "per-layer page rescue",
    "device_memory_bytes": "KV offload", "kernel": "the Triton kernel",
}


def _recompile_limit(engine: dict[str, Any]) -> int | None:
    """Graphs the engine's step may need: one per padded query size
    (``max_batch_tokens / q_padding_interval_size``) and padded KV size (the cache's tokens,
    ``num_blocks`` x ``page_size``, over ``kv_padding_interval_size``; one when unset), plus
    two; None when the engine does not pad queries (``q_padding_interval_size`` unset: sizes
    are not bounded here)."""
    interval = engine.get("q_padding_interval_size")
    if not interval:
        return None
    queries = -(-(engine.get("max_batch_tokens") or 512) // interval)
    kv_interval, blocks = engine.get("kv_padding_interval_size"), engine.get("num_blocks")
    page = engine.get("page_size") or engine.get("block_size") or 256
    kv_sizes = -(-(blocks * page) // kv_interval) if kv_interval and blocks else 1
    return queries * kv_sizes + 2


def raise_recompile_limit(limit: int | None) -> None:
    """Raise ``torch._dynamo.config.recompile_limit`` to ``limit`` (None: leave it) in *this
    thread*: torch's config overrides are thread-local, and Hugging Face's engine compiles its
    step in a thread of its own, so the backend calls this as it compiles. Past the limit
    torch would run a new shape of the step eagerly, without the backend (dense)."""
    if limit is not None and recompile_limit() < limit:
        logger.info("specontext: torch._dynamo.config.recompile_limit %d -> %d in this thread (one compile per "
                    "padded query size of the engine's step)", recompile_limit(), limit)
        set_recompile_limit(limit)


def check_options(options: dict[str, Any] | None) -> None:
    """Refuse, before anything loads, options that are bad or that the continuous-batching step
    does not build (the checks :func:`continuous_batching_config` makes; ``ValueError`` naming
    the option). Needs no model: a server checks them before its model's process starts."""
    _check_built(SpeContextConfig.from_options(options), options or {})


def _check_built(config: SpeContextConfig, options: dict[str, Any]) -> None:
    """Refuse options the continuous-batching step does not build (a clear error instead of
    an option silently ignored)."""
    defaults = SpeContextConfig()
    options = flatten_options(options)  # grouped options are checked by their names too
    given = sorted(name for name in _NOT_BUILT if name in options and options[name] != getattr(defaults, name))
    if given:
        raise ValueError(f"continuous batching does not build {', '.join(_NOT_BUILT[n] for n in given)} yet "
                         f"(option(s) {given}); drop them (docs/serving.md, 'Not built yet')")


#: live backends, so that a block copy of the engine reaches their states (no strong reference)
_BACKENDS: weakref.WeakSet = weakref.WeakSet()


def _copy_state_with_blocks() -> None:
    """Make ``PagedAttentionCache.perform_cache_copy`` (the engine forking a request: parallel
    sampling) copy our state of the copied blocks too (:meth:`~.runtime.paged.PagedState.copy_blocks`),
    for the process, logged once. The states are found by the layer-0 key view of the
    copying allocator, as the backend keys them."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    original = PagedAttentionCache.perform_cache_copy
    if getattr(original, "_specontext", False):
        return

    def perform_cache_copy(cache, copy_src_and_dst):
        original(cache, copy_src_and_dst)
        for name, (source, dest) in copy_src_and_dst.items():
            views = getattr(cache.cache_allocators[name], "_kv_token_views", {})
            if source and not views:  # Hugging Face's allocator changed: say so rather than fork with stale state
                logger.warning("specontext: a block copy of the engine (a forked request) could not find the cache's "
                               "layer views; the copies' lagged queries and page bounds are not copied (the forked "
                               "request may select otherwise than its parent)")
                continue
            first = views[min(views)][0]
            for backend in list(_BACKENDS):
                state = backend.states.get(id(first))
                if source and state is not None:
                    state.copy_blocks(list(source), list(dest))

    perform_cache_copy._specontext = True
    perform_cache_copy.__wrapped__ = original
    PagedAttentionCache.perform_cache_copy = perform_cache_copy
    logger.info("specontext: PagedAttentionCache.perform_cache_copy also copies the retrieval state of the copied "
                "blocks (a forked request selects as its parent)")


def _traceable_cache_update() -> None:
    """Make ``PagedAttentionCache.update`` traceable by dynamo (see the module docstring)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    wrapped = getattr(PagedAttentionCache.update, "__wrapped__", None)
    if wrapped is not None:
        PagedAttentionCache.update = wrapped
        logger.info("specontext: PagedAttentionCache.update made traceable (its torch.compiler.disable removed) "
                    "so that the continuous-batching step compiles as one graph")


def _check_model(model: torch.nn.Module) -> None:
    """Refuse a model whose layers Hugging Face's engine caches other than as full attention
    (its own grouping: sliding-window layers live in a ring buffer, whose packed columns are
    not in position order; measured: wrong tokens at a budget covering the context)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    groups = sorted(group_layers_by_attn_type(config))
    if groups != ["full_attention"]:
        raise ValueError(f"specontext's continuous-batching step is built for full-attention layers only; Hugging "
                         f"Face's engine groups this model's layers as {groups} (sliding-window layers are cached in "
                         "a ring buffer). Run it with transformers' own ContinuousBatchingConfig (dense), or one "
                         "request at a time through specontext_compile.compile")


def continuous_batching_config(model: torch.nn.Module, options: dict[str, Any] | None = None, **engine: Any):
    """A ``ContinuousBatchingConfig`` whose steps compile with the specontext backend.

    Args:
        model: the model that will run ``generate_batch`` / ``init_continuous_batching``
            with it (checked: full-attention layers only).
        options: backend options (:class:`~.config.SpeContextConfig`; ``budget``,
            ``sink_tokens``, ``recent_window``, ``retrieval_layers``, ``inner``, ...).
        **engine: ``ContinuousBatchingConfig`` fields (``max_batch_tokens``, ``num_blocks``,
            ``page_size``, ``max_requests_per_batch``, ``q_padding_interval_size``,
            ``kv_padding_interval_size``, ...); ``varlen_compile_config`` is
            ours. On CPU set ``num_blocks`` and ``max_batch_tokens``: Hugging Face sizes the
            cache from the host's memory otherwise.

    Returns:
        ``transformers.ContinuousBatchingConfig``; :func:`path_counts` reads its counters.

    Raises:
        ValueError: unknown or bad options (before anything runs), options this step does
            not build, a model with sliding-window layers, ``varlen_compile_config`` given
            (the backend is the compile configuration), or ``max_batch_tokens=1``
            (:func:`~.runtime.paged.sampled_rows` could not tell prompt tokens from decode
            tokens).
    """
    from transformers import ContinuousBatchingConfig
    from transformers.generation.configuration_utils import CompileConfig

    if "varlen_compile_config" in engine:
        raise ValueError("continuous_batching_config sets varlen_compile_config itself (the specontext "
                         "backend); pass backend options as `options` instead")
    if engine.get("max_batch_tokens") == 1:
        raise ValueError("max_batch_tokens=1 schedules every prompt token alone in a step whose logits_to_keep is "
                         "all padding, so the step cannot tell a prompt token from a decode token (it would attend "
                         "prompt tokens sparsely); use max_batch_tokens >= 2")
    _check_model(model)
    backend = PagedBackend(options, engine.get("max_requests_per_batch"))
    limit = _recompile_limit(engine)

    def specontext_paged(gm, example_inputs, **kwargs):  # a function: Hugging Face deep-copies the config
        raise_recompile_limit(limit)  # in the thread that compiles: the engine's, not the caller's
        return backend(gm, example_inputs, **kwargs)

    specontext_paged.backend = backend
    _traceable_cache_update()
    _copy_state_with_blocks()
    engine.setdefault("auto_switch_to_flash", False)
    compile_config = CompileConfig(backend=specontext_paged, mode="default", fullgraph=False, dynamic=False)
    return ContinuousBatchingConfig(varlen_compile_config=compile_config, **engine)


def path_counts(cb_config) -> dict[str, int]:
    """The counters (:data:`~.runtime.paged.PAGED_STATS`) of every cache the configuration's
    backend has stepped, summed: ``steps``, ``sparse_steps``, ``dense_steps``,
    ``mixed_steps``, ``sparse_sites``, ``recency_rows``, ``refined_sites`` (sites that kept
    their own budget of the candidates: option ``candidates`` > 1 or the page rescue),
    ``one_token_chunks`` (one-row requests still prefilling, attended densely),
    ``rescued_sites`` (refined sites whose candidates took in the rescued pages)."""
    return cb_config.varlen_compile_config.backend.backend.counts()


def state_bytes(cb_config) -> int:
    """The most bytes of retrieval state the configuration's backend kept at once beside the
    engine's KV cache (lagged queries and their stamps per block, page bounds per page,
    counters: :class:`~.runtime.paged.PagedState`), over every cache it stepped."""
    return cb_config.varlen_compile_config.backend.backend.peak_state_bytes
