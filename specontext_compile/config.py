"""Validated configuration of the specontext backend (``torch.compile(..., options=...)``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

__all__ = ["ALL_TOKENS", "MAX_RETRIEVAL_LAYERS", "MODES", "OPTION_GROUPS", "CompileOptions", "DebugOptions",
           "OffloadOptions", "SelectionOptions", "SpeContextConfig", "candidate_slots", "default_retrieval_layers",
           "flatten_options"]

_INNER = ("auto", "eager", "inductor")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
from .runtime.key_mirror import DEFAULT_SELECTION_KEYS, SELECTION_KEYS
from .runtime.retrieval import MAX_RETRIEVAL_LAYERS, default_retrieval_layers
from .runtime.spec import ALL_TOKENS, KERNELS, candidate_slots


def _layer_set(name: str, layers: Any, none_ok: bool = True) -> tuple[int, ...] | None:
    """An option naming decoder layers (an int or ints, negative counts from the end; None,
    where ``none_ok``, = every layer), as a sorted tuple of distinct ints.

    Raises:
        ValueError: anything else, naming the option and what it takes."""
    if layers is None and none_ok:
        return None
    given = layers
    layers = (layers,) if isinstance(layers, int) and not isinstance(layers, bool) else layers
    layers = tuple(layers) if isinstance(layers, (list, tuple)) else layers
    if not isinstance(layers, tuple) or any(not isinstance(j, int) or isinstance(j, bool) for j in layers):
        takes = "None, an int or a tuple of ints" if none_ok else "an int or a tuple of ints"
        raise ValueError(f"specontext option {name!r} must be {takes} (decoder layers; negative counts from "
                         f"the end), got {given!r}")
    return tuple(sorted(set(layers)))


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"specontext option {name!r} must be an int >= {low}, got {value!r}")


def _check_flag(name: str, value: Any, none_ok: bool = False) -> None:
    if not (isinstance(value, bool) or (none_ok and value is None)):
        takes = "None, True or False" if none_ok else "True or False"
        raise ValueError(f"specontext option {name!r} must be {takes}, got {value!r}")


def _retrieval_layers(layers: Any) -> tuple[int, ...] | None:
    given = layers
    if isinstance(layers, list):
        layers = tuple(layers)
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    if layers is not None and (
        not isinstance(layers, tuple) or not layers or len(layers) > MAX_RETRIEVAL_LAYERS
        or any(not isinstance(j, int) or isinstance(j, bool) for j in layers)
    ):
        raise ValueError(f"specontext option 'retrieval_layers' must be None, an int or 1..{MAX_RETRIEVAL_LAYERS} "
                         f"ints, got {given!r}")
    return layers


@dataclasses.dataclass(frozen=True)
class SelectionOptions:
    """What a decode step selects and how (SpeContext, arXiv 2512.00722, section 4): the
    options of the same names documented on :class:`SpeContextConfig`, validated here (read by
    the rewrite pass and :meth:`~specontext_compile.runtime.spec.StepSpec.from_config`).

    Raises:
        ValueError: a value out of range, naming the option and what it takes."""

    budget: int = 1024
    sink_tokens: int = 4
    recent_window: int = 64
    retrieval_layers: tuple[int, ...] | int | None = None
    retrieval_head: str | None = None
    candidates: float = 1.0
    page_rescue: int | None = None
    rescue_layers: tuple[int, ...] | int | None = None
    dense_layers: tuple[int, ...] | int = ()
    min_coverage: float = 0.0
    max_sparse_q_len: int = 1
    dense_shortcut: bool = True
    dense_below: int = 0
    selection_keys: str = DEFAULT_SELECTION_KEYS

    def __post_init__(self) -> None:
        _check_int("budget", self.budget, 1)
        _check_int("max_sparse_q_len", self.max_sparse_q_len, 1)
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("recent_window", self.recent_window, 0)
        object.__setattr__(self, "retrieval_layers", _retrieval_layers(self.retrieval_layers))
        object.__setattr__(self, "dense_layers", _layer_set("dense_layers", self.dense_layers, none_ok=False))
        object.__setattr__(self, "rescue_layers", _layer_set("rescue_layers", self.rescue_layers))
        if self.retrieval_head is not None:
            from .runtime.draft_retrieval import head_spec

            object.__setattr__(self, "retrieval_head", head_spec(self.retrieval_head).path)  # ValueError naming the fix
        below = self.dense_below
        if not isinstance(below, int) or isinstance(below, bool) or below < 0:
            raise ValueError(f"specontext option 'dense_below' must be an int >= 0 (store tokens at or below which "
                             f"attention stays dense; 0 = never), got {below!r}")
        _check_flag("dense_shortcut", self.dense_shortcut)
        if self.selection_keys not in SELECTION_KEYS:
            raise ValueError(f"specontext option 'selection_keys' must be one of {SELECTION_KEYS} (what the "
                             f"selection scores: the stores' keys, or their int8 copy), got {self.selection_keys!r}")
        c = self.candidates
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 1.0:
            raise ValueError(f"specontext option 'candidates' must be a number >= 1 (candidate tokens as a "
                             f"multiple of the budget; 1 = one shared selection; inf = every cached token), "
                             f"got {c!r}")
        object.__setattr__(self, "candidates", float(c))
        g = self.min_coverage
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g < 1.0:
            raise ValueError(f"specontext option 'min_coverage' must be a number in [0, 1) (0 = guard off), "
                             f"got {g!r}")
        object.__setattr__(self, "min_coverage", float(g))
        r = self.page_rescue
        if r is None:  # the default: the rescue that keeps the text (with or without offload: same text)
            r = 2 * self.budget
            object.__setattr__(self, "page_rescue", r)
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"specontext option 'page_rescue' must be None (the default: 2 x budget) or an "
                             f"int >= 0 (tokens of rescued pages per layer; 0 = off), got {r!r}")
        if g > 0 and self.candidates <= 1 and r == 0:
            raise ValueError("specontext option 'min_coverage' needs a refinement to estimate from: "
                             "'candidates' > 1 or 'page_rescue' > 0 (the guard's estimate is the share of "
                             "the ranked tokens' attention that each layer keeps); set candidates=2 or leave "
                             "page_rescue at its default")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How the rewritten graph is compiled (the backend's business): the options of the same
    names documented on :class:`SpeContextConfig`, validated here.

    Raises:
        ValueError: a value out of range, naming the option and what it takes."""

    inner: str | Callable = "auto"
    kernel: str = "auto"
    mode: str | None = None
    lower: bool = True
    freezing: bool | None = None
    gemv: bool | None = None
    regional: bool | None = None

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"specontext option 'kernel' must be one of {KERNELS}, got {self.kernel!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"specontext option 'mode' must be None or one of {MODES}, got {self.mode!r}")
        _check_flag("lower", self.lower)
        for name in ("freezing", "gemv", "regional"):
            _check_flag(name, getattr(self, name), none_ok=True)
        if not callable(self.inner) and self.inner not in _INNER:
            raise ValueError(f"specontext option 'inner' must be one of {_INNER} or a runner (a callable taking "
                             f"the lowered graph module, as specontext_compile.recall.RecallProbe.runner), "
                             f"got {self.inner!r}")


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """KV offload to a host tier (section 5-6; docs/offload.md): the options of the same names
    documented on :class:`SpeContextConfig` (``device_memory_bytes`` None = off), validated here.

    Raises:
        ValueError: a value out of range, or ``offload_trace`` without offload."""

    device_memory_bytes: int | str | None = None
    copy_bandwidth: float | None = None
    offload_trace: str | None = None

    def __post_init__(self) -> None:
        dm = self.device_memory_bytes
        if dm is not None and dm != "auto" and (not isinstance(dm, int) or isinstance(dm, bool) or dm < 1):
            raise ValueError(
                f"specontext option 'device_memory_bytes' must be None, an int >= 1 (bytes of "
                f"the device tier) or 'auto' (free device memory), got {dm!r}")
        bw = self.copy_bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < math.inf):
            raise ValueError(f"specontext option 'copy_bandwidth' must be None or a positive number of bytes/s "
                             f"(the offload schedule's host-to-device copy rate), got {bw!r}")
        if bw is not None:
            object.__setattr__(self, "copy_bandwidth", float(bw))
        if self.offload_trace is not None and (dm is None or not isinstance(self.offload_trace, str)):
            raise ValueError("specontext option 'offload_trace' must be a file path (str) and needs "
                             "device_memory_bytes (offload) to be set")


@dataclasses.dataclass(frozen=True)
class DebugOptions:
    """What the backend writes for a person to read: graph dumps (``dump_dir``)."""

    dump_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise ValueError(f"specontext option 'dump_dir' must be None or a folder path (str), got {self.dump_dir!r}")


#: group name -> its dataclass; every option of :class:`SpeContextConfig` is in exactly one
OPTION_GROUPS = {"selection": SelectionOptions, "compile": CompileOptions, "offload": OffloadOptions,
                 "debug": DebugOptions}


def _group_fields(group: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(group))


#: option name -> the name of the group that holds it
_GROUP_OF = {field: name for name, group in OPTION_GROUPS.items() for field in _group_fields(group)}


def flatten_options(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` options with any group given as a dict (``{"selection": {"budget":
    512}}``) or a group instance spread into its flat names (the rest unchanged).

    Raises:
        ValueError: a group's dict names an option of another group or none (the message
            lists the group's options), or an option given both flat and in its group.
    """
    flat = {k: v for k, v in options.items() if k not in OPTION_GROUPS}
    for name, group in OPTION_GROUPS.items():
        if options.get(name) is None:  # absent, or None: the group's defaults
            continue
        given = options[name]
        if isinstance(given, group):
            given = dataclasses.asdict(given)
        _check_group_dict(name, group, given)
        twice = sorted(set(given) & set(flat))
        if twice:
            raise ValueError(f"specontext option(s) {twice} given both on their own and in group {name!r}; "
                             "give each once")
        flat.update(given)
    return flat


def _check_group_dict(name: str, group: type, given: Any) -> None:
    """``given``, group ``name``'s options as a dict, names only options of that group.

    Raises:
        ValueError: not a dict, or a name of another group or none (listing the group's options)."""
    if not isinstance(given, dict):
        raise ValueError(f"specontext option group {name!r} must be a dict or a {group.__name__}, "
                         f"got {type(given).__name__}")
    unknown = sorted(set(given) - set(_group_fields(group)))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} in specontext option group {name!r}; "
                         f"its options are {list(_group_fields(group))}")


def _build_group(name: str, group: type, given: Any, options: dict[str, Any]):
    """Group ``name`` of a config: ``given`` (None, a dict of its options or an instance) with
    ``options`` (flat names of the group) on top.

    Raises:
        ValueError: ``given`` of another type, or a dict naming an option of another group."""
    if given is None:
        return group(**options)  # flat names build their group (its defaults derived from them)
    if not isinstance(given, group):
        _check_group_dict(name, group, given)
        return group(**{**given, **options})
    if not options:
        return given
    if (group is SelectionOptions and "budget" in options and "page_rescue" not in options
            and given.page_rescue == 2 * given.budget):
        options = {**options, "page_rescue": None}  # the default rescue follows the new budget
    return dataclasses.replace(given, **options)


@dataclasses.dataclass(frozen=True, init=False)
class SpeContextConfig:
    """Options of ``backend="specontext"``, stored as their four groups (:data:`OPTION_GROUPS`:
    ``config.selection``, ``config.compile``, ``config.offload``, ``config.debug``; each group
    validates its own fields, this class the rules across groups) and read by their flat names
    too (``config.budget``). Built from flat names, groups, or both
    (``SpeContextConfig(budget=512)``, :meth:`from_options`).

    Attributes:
        budget: tokens selected per KV head per decode step (int >= 1); SpeContext
            (arXiv 2512.00722) evaluates 512-4096. When the context is not longer than the
            budget, every token is selected and attention is exact.
        sink_tokens: first tokens always kept (attention sinks), counted in ``budget``.
        recent_window: last tokens always kept (includes the current one), in ``budget``.
            When ``sink_tokens + recent_window`` exceeds the budget, the window is kept
            first and the sinks are cut.
        retrieval_layers: decoder layers whose previous-step queries drive the training-free
            retrieval head (their scores are summed); an int or a tuple of at most
            ``MAX_RETRIEVAL_LAYERS`` ints, negative counting from the end. None picks
            eight layers over the whole depth (2, 4, 8, 12, 16, 20, 24, 28 of 30; see
            :func:`default_retrieval_layers`), the best measured on SmolLM2
            (docs/design.md, docs/fidelity.md).
        max_sparse_q_len: the longest step (query tokens) that may run sparse. The rule
            (docs/design.md, "Which steps are sparse"): a one-token step with a past is a
            decode step and runs sparse; a step of several tokens is prefill unless this
            option says otherwise — a whole prompt, a chunk of ``generate(...,
            prefill_chunk_size=N)``, a new chat turn appended to a reused cache, an
            assisted-decoding verification — and stays dense and exact. Default 1: only
            one-token decode steps are sparse. Raising it to ``N`` declares every step of up
            to ``N`` tokens a decode step (e.g. speculative verification you want sparse):
            prefill chunks of up to ``N`` tokens then run sparse too. (Compile with
            ``dynamic=False`` then: dynamo otherwise makes the query length of a step after
            one of another length symbolic, and a symbolic step stays dense.)
        inner: compiler for the rewritten graph: ``"auto"`` (default: inductor for decode
            graphs, those with a rewritten site, where it removes the host from the step;
            with KV offload too, whose ops only move rows;
            prefill and pass-through graphs run eager, since compiling them costs time and
            gains little), ``"inductor"`` (every graph) or ``"eager"`` (the same lowered step
            run by the FX graph module's Python, without inductor: the debugging path, the
            same functions and numbers up to inductor's fusion; with ``lower=False`` our ops
            are called one by one instead), or a runner: a callable given the graph module
            ``"eager"`` runs, returning the function to call for each step (the recall probe,
            :class:`~specontext_compile.recall.RecallProbe`, runs it with an ``fx.Interpreter``).
        kernel: sparse attention implementation: ``"auto"`` (generated Triton kernels on
            CUDA, the torch path elsewhere), ``"torch"``, or ``"triton"`` (on CPU this needs
            ``TRITON_INTERPRET=1``: the kernels then run in Triton's interpreter; small
            shapes only, for testing).
        device_memory_bytes: size of the device tier in bytes; enables KV offload to a host
            tier with elastic loading and prefetch (docs/offload.md). None (default) = off:
            every layer stays on the device and the graph is unchanged. On CPU it emulates a
            small device tier. Needs a cache with an offload manager
            (``specontext_compile.compile`` attaches one). ``"auto"``: the device's free
            memory (plus the weights) when the plan is made.
        copy_bandwidth: host-to-device copy rate in bytes/s for the offload schedule's cost
            model; None = this machine's calibration, measured once and kept on disk
            (``runtime/calibration.py``). Part of the schedule pass's uuid.
        offload_trace: path of a Chrome-trace JSON of the latest decode step (offload only).
        retrieval_head: folder (or shipped name, e.g. ``"smollm2-135m-fused"``) of a draft retrieval head (``config.json`` +
            ``model.safetensors``, EAGLE-3 layout; SpeContext section 4) that the selection
            uses instead of the training-free lagged-query head (``retrieval_layers`` is then
            unused): embedding-only heads (``specontext distill --variant embedding``) and
            fused ones (the target's previous-token hidden states at the head's auxiliary
            layers, recorded in the graph). The ``SpeContextCache`` must be built with the
            same folder (``specontext_compile.compile`` does it). Stored resolved (absolute).
            A bad folder is a ``ValueError`` naming the fix. Not with ``device_memory_bytes``
            yet.
        selection_keys: what the lagged-query selection scores on the CPU: ``"int8"``
            (default) an int8 copy of the retrieval layers' keys with one float32 scale a
            row, kept by the ``SpeContextCache`` (whose default is the same) and written by
            every ``kv_write`` with the keys (``runtime/key_mirror.py``), scored with the query
            rounded to int8 as well: 68 bytes a key row at head_dim 64 against 256 (float32)
            or 128 (bfloat16); or ``"store"``: the keys themselves (the cache then keeps no
            int8 rows). Attention and refinement always read the model's keys. Where the int8 rows cannot apply (a cache without them, Hugging
            Face's StaticCache, MLA, the torch or Triton selection, a GPU) the selection reads
            the stores (logged; at debug level off the CPU kernel).
        dump_dir: folder for graph dumps before/after the passes (text and DOT, see
            ``passes/dump.py``); None falls back to ``$SPECONTEXT_DUMP_DIR``, else no dumps.
            Does not change the rewrite (not part of the pass uuid).
        mode: ``torch.compile`` mode for the inner compiler (``"default"``,
            ``"reduce-overhead"`` = CUDA graphs, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``); None takes the mode given to
            ``torch.compile`` (which refuses ``mode`` together with ``options``, hence this
            option). It applies to the graphs inductor compiles (see ``inner``).
        lower: replace the ``specontext::`` ops by their sync-free aten bodies
            (``passes/lower.py``), so inductor fuses them into the step instead of calling
            them back as opaque ops, and ``inner="eager"`` runs that same step. False keeps
            them opaque (the eager op chain: its dynamo counters and the recall probe of
            ``specontext report``).
        dense_shortcut: when the budget covers a layer's whole store (decided from shapes at
            compile time), attend densely over the store (SDPA, contiguous reads) instead of
            gathering every slot; exact either way. False always runs the gather path
            (tests use it to check the sparse path at full budget, issue 12).
        dense_below: attend densely over a layer's whole store (exact) when the store holds
            at most this many tokens (an int >= 0; 0 = never, the default): below the
            context where the sparse step gets faster than dense on the machine at hand
            (docs/benchmarks.md, "Dense below a crossover": between 16K and 32K tokens on a
            2-core Zen 4 CPU with the default options). Decided per compile from the store's
            static capacity; when every site is dense the step makes no selection. Needs
            ``dense_shortcut``.
        candidates: two-stage selection (issue 12): the selection node picks
            ``ceil(candidates * budget)`` candidate tokens per KV head once per step, before
            the first layer (what KV offload prefetches); each layer then keeps the
            ``budget`` of them that its own current query attends to most (group max, as
            the paper's GQA rule), so layers no longer share one selection. A float >= 1;
            1.0 = one selection shared by every layer (the paper's design). Costs one read
            of the candidates' keys per layer. With KV offload the step prefetches the
            candidates (:attr:`prefetch_tokens` rows per offloaded layer's buffer) and an
            offloaded layer refines them from its device buffer. ``float("inf")``: every
            cached token is a candidate, so each layer keeps its own exact top ``budget``
            (the per-layer oracle; the paper's "layer-wise retrieval"): it reads every key
            of every layer, in place (no gather), and cannot be offloaded.
        min_coverage: the fidelity guard (0.0 = off, the default; needs a refinement:
            ``candidates > 1`` or ``page_rescue > 0``): per layer and step, the share of the
            ranked tokens' attention mass (the layer's own softmax over the candidates and
            the rescued pages' tokens) that the kept ``budget`` tokens hold, for the worst
            KV head and query head; below ``min_coverage`` the layer attends densely (exact)
            for that step. Counted in ``cache.path_counts()["guard_dense_sites"]``. On CUDA
            it costs one host read per guarded layer and step (the branch). A float in
            ``[0, 1)``. Not with KV offload (``device_memory_bytes``): ``ValueError``.
        page_rescue: tokens each layer adds to the step's candidates before refining them
            (issue 12): the tokens of the pages (``SpeContextCache(page_tokens=16)``) with the
            highest Quest bound ``sum_c max(q_c min_c, q_c max_c)`` under the layer's own
            current query, read from per-page key bounds the KV store keeps
            (:mod:`~specontext_compile.runtime.page_bounds`), rounded up to whole pages. It
            brings back what the layer's current query attends to and the lagged-query
            candidates missed, at the cost of reading the bounds (``2/16`` of the keys) and
            the rescued keys; it turns the refinement on even at ``candidates=1``. None (the
            default) = ``2 * budget`` (what it buys and costs: docs/fidelity.md, "Page
            rescue", and docs/benchmarks.md); 0 = off; an int
            >= 0 = that many tokens. With KV offload the bounds stay on the device and an
            offloaded layer loads the rescued tokens it lacks from the host tier on demand
            (its buffer has :attr:`buffer_tokens` rows; not prefetched: set 0 to keep every
            transfer prefetched), with the same text as without offload. Sites whose
            store keeps no bounds (MLA, Hugging Face's ``StaticCache``, a cache built with
            ``page_tokens=0``) refine without it (logged).
        rescue_layers: the KV (attention) layers, counted as ``retrieval_layers`` are, whose
            sites refine with the page rescue; the others attend to the step's shared
            candidates (at ``candidates=1``: the shared selection, no per-layer work). An int
            or a tuple of ints (negative counts from the end; a layer the model lacks is
            logged as a warning); ``()`` = none (``page_rescue=0`` bit for bit); None = every
            layer. Each rescued layer costs the rescue's reads and ranking
            (docs/benchmarks.md, "Rescue at fewer layers").
        dense_layers: KV (attention) layers, counted as ``retrieval_layers`` are, whose
            decode attention stays dense and exact (their sites are not rewritten; the
            reason is logged), as Quest and ShadowKV keep their first layers dense: a layer
            whose attention is spread over the whole context loses most to any budget. An
            int or a tuple of ints (negative counts from the end; a layer the model lacks is
            logged as a warning and keeps nothing dense); ``()`` (the default) = none. The
            step still runs its selection for the other layers. Each costs a read of that layer's whole KV
            per step. A dense layer can still be a retrieval layer (its query is recorded).
            With KV offload (``device_memory_bytes``) a dense layer is never offloaded: its
            whole store stays on the device, counted there by the memory model at every
            length (naming every layer is then a ``ValueError`` from ``sc.compile`` or
            ``enable_offload``). A dense layer's attention scratch (e.g. Hugging Face's
            ``repeat_kv`` copy of its keys and values on the SDPA path) is not modelled.
        freezing: True: the parameters are folded into the graph (``freezing.py``) and inductor
            freezes them (constant weights, packed for oneDNN on CPU; with ``mode="max-autotune"``
            and ``gemv=False`` its CPP GEMM template: bf16 steps 1.2x faster on a Xeon with AMX,
            docs/benchmarks.md, "Freezing that takes effect"); CPU graphs compiled whole (it turns
            ``regional`` off by default), under ``torch.no_grad()``; weights changed later are
            not seen. None: inductor's freezing patch for CPU graphs, which folds nothing (the
            weights stay graph inputs). False: neither.
        gemv: with inductor, compute one-row linear layers (batch-1 decode) as a fused
            multiply-and-sum that inductor vectorises (``passes/gemv.py``: the weights are
            then read near the copy rate on CPU); None = on for CPU graphs, off on CUDA.
        regional: regional compilation (``regional.py``): inductor compiles each distinct
            decoder layer once and the graph calls it for every layer of its kind (the first
            step of 30-layer SmolLM2 compiles several times faster); each layer is an
            ``invoke_subgraph`` call inside one compiled graph; its graphs are not frozen
            (weights stay inputs; docs/benchmarks.md, "One compiled call per step"). None = on
            for CPU graphs unless ``freezing=True``; off on CUDA (not yet measured there).
    """

    selection: SelectionOptions = dataclasses.field(default_factory=SelectionOptions)
    compile: CompileOptions = dataclasses.field(default_factory=CompileOptions)
    offload: OffloadOptions = dataclasses.field(default_factory=OffloadOptions)
    debug: DebugOptions = dataclasses.field(default_factory=DebugOptions)

    def __init__(self, selection: SelectionOptions | None = None, compile: CompileOptions | None = None,
                 offload: OffloadOptions | None = None, debug: DebugOptions | None = None, **options: Any) -> None:
        """The options stored as their groups; flat names (``budget=512``) go to their group, on
        top of a group given whole (as ``dataclasses.replace`` passes them).

        Raises:
            ValueError: an unknown name (the message lists the valid ones), a bad value (from
                the group that holds it), or options of two groups that cannot be combined."""
        unknown = sorted(set(options) - set(_GROUP_OF))
        if unknown:
            raise ValueError(f"unknown specontext option(s) {unknown}; valid options are {list(_GROUP_OF)}")
        given = {"selection": selection, "compile": compile, "offload": offload, "debug": debug}
        for name, group in OPTION_GROUPS.items():
            mine = {k: v for k, v in options.items() if _GROUP_OF[k] == name}
            object.__setattr__(self, name, _build_group(name, group, given[name], mine))
        self._check_combinations()

    def _check_combinations(self) -> None:
        """The rules across groups (each group checks its own fields)."""
        dm = self.offload.device_memory_bytes
        if dm is None:
            return
        if self.selection.retrieval_head is not None:
            raise ValueError("specontext options 'retrieval_head' and 'device_memory_bytes' cannot be "
                             "combined yet (the offload schedule reads the lagged-query selection); "
                             "unset one of them")
        if self.selection.candidates == math.inf:
            raise ValueError("specontext options candidates=inf and 'device_memory_bytes' cannot be combined: "
                             "every layer would read every cached key, so nothing can stay on the host tier; "
                             "set a finite candidates (e.g. 4) or unset device_memory_bytes")
        if self.selection.min_coverage > 0:
            raise ValueError("specontext options 'min_coverage' > 0 and 'device_memory_bytes' cannot be combined "
                             "yet (the guard's dense fallback would read an offloaded layer's host tier); set "
                             "min_coverage=0 or unset device_memory_bytes")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_GROUP_OF))

    def __getattr__(self, name: str) -> Any:
        """An option by its flat name (``config.budget``), read from the group that holds it."""
        group = _GROUP_OF.get(name)
        if group is None:  # not an option (also while unpickling, before the groups are set)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    @property
    def prefetch_tokens(self) -> int:
        """Tokens per KV head the selection node picks and KV offload prefetches each step:
        ``ceil(candidates * budget)`` (with ``page_rescue`` 0, the rows of an offloaded
        layer's device buffer: :attr:`buffer_tokens`)."""
        return candidate_slots(self.budget, self.candidates)

    @property
    def buffer_tokens(self) -> int:
        """Rows per KV head of an offloaded layer's device buffer: the prefetched candidates
        (:attr:`prefetch_tokens`) plus, with ``page_rescue``, the rescued pages' tokens
        (rounded up to whole 16-token pages), loaded on demand."""
        from .runtime.page_bounds import PAGE_TOKENS

        return self.prefetch_tokens + -(-self.page_rescue // PAGE_TOKENS) * PAGE_TOKENS

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> SpeContextConfig:
        """Build from ``torch.compile`` options: flat names, or groups (:data:`OPTION_GROUPS`)
        given as dicts or group instances (``{"selection": {"budget": 512}, "compile":
        {"inner": "eager"}}``), or both (each option once).

        Raises:
            ValueError: for an unknown option (the message lists the valid names), an option
                in the wrong group or given twice (:func:`flatten_options`), or a bad value.
        """
        options = dict(options or {})
        # a group instance is passed as it is (its fields not spread: a flat name then goes on
        # top of it, and a runner given as `inner` stays the same object)
        groups = {name: options.pop(name) for name, group in OPTION_GROUPS.items()
                  if isinstance(options.get(name), group)}
        return cls(**groups, **flatten_options(options))
