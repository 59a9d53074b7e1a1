"""``explain``: what the specontext backend does to a model, without reading logs.

Runs one prefill and one decode step of ``model`` through ``torch.compile(...,
backend="specontext")`` with a :class:`SpeContextCache` and reports, per compiled graph,
every attention site (layer, pattern, heads, KV heads, head_dim, sliding window, soft cap,
rewritten or the reason it stays dense), the rewrite counters, where the selection
node(s) sit and which retrieval head scores them (lagged query or a draft head).
The model's weights and its own ``forward`` are not changed.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .backend import CompileReport, compile_reports
from .config import SpeContextConfig
from .passes.sites import ANCHOR, KV_WRITE, is_op
from .runtime import aten_step, mla, offload_step, scorers
from .runtime.kv_cache import SpeContextCache
from .runtime.protocol import op_arguments
from .runtime.torch_private import counters

__all__ = ["Explanation", "SiteRow", "explain"]

_SPARSE = torch.ops.specontext.sparse_attention.default
_ATTENTION = (_SPARSE, offload_step.attention,
              aten_step.guarded_attention, aten_step.sinks_attention, mla.attend_latent)  # sites no kernel serves


@dataclasses.dataclass
class SiteRow:
    """One attention site of one compiled graph."""

    graph: int
    phase: str
    layer: int | None
    pattern: str
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    q_len: int | None
    window: int | None
    soft_cap: float | None
    rewritten: bool
    reason: str | None


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found. ``rows``: every site of every graph compiled for the
    call; ``counters``: ``torch._dynamo`` counters of the specontext backend accumulated by
    the call; ``selections``: per decode graph, where each selection node sits;
    ``pass_uuids``: the identity of the pass per graph; ``heads``: per decode graph, the
    retrieval head its selection uses; ``reports``: the raw reports."""

    rows: list[SiteRow]
    counters: dict[str, int]
    selections: list[str]
    pass_uuids: list[str]
    heads: list[str] = dataclasses.field(default_factory=list)
    reports: list[CompileReport] = dataclasses.field(repr=False, default_factory=list)
    offload: dict[str, Any] | None = None  # with device_memory_bytes: the plan (see _offload_plan)
    steps: list[str] = dataclasses.field(default_factory=list)  # per decode graph: the step's calls

    def table(self) -> str:
        """A plain-text table of the sites, then the counters and the selection placement."""
        head = ("graph", "phase", "layer", "pattern", "heads", "kv", "dim", "q", "window", "cap", "rewritten / reason")
        rows = [head] + [
            (str(r.graph), r.phase, _s(r.layer), r.pattern, _s(r.heads), _s(r.kv_heads), _s(r.head_dim),
             _s(r.q_len), _s(r.window), _s(r.soft_cap), "rewritten" if r.rewritten else f"dense: {r.reason}")
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append("")
        lines.append("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counters.items())))
        lines += [f"selection: {s}" for s in self.selections] or ["selection: none inserted"]
        lines += [f"selection head: {h}" for h in self.heads]
        lines += [f"step: {s}" for s in self.steps]
        lines += [f"pass: {u}" for u in sorted(set(self.pass_uuids))]
        if self.offload is not None:
            o = self.offload
            lines.append(f"offload: {o['model']}")
            lines += [f"offload step {s['step']}: {s['length']} tokens, {s['offloaded']} layer(s) offloaded, "
                      f"expected device bytes {s['device_bytes']}, bytes moved {s['bytes_elastic']} "
                      f"(full reload {s['bytes_full_reload']})" for s in o["steps"]]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [dataclasses.asdict(r) for r in self.rows], "counters": self.counters,
                "selections": self.selections, "pass_uuids": sorted(set(self.pass_uuids)),
                "heads": self.heads, "offload": self.offload, "steps": self.steps}


def _s(x) -> str:
    return "-" if x is None else str(x)


def _consumers(node: torch.fx.Node, depth: int) -> list[torch.fx.Node]:
    """Nodes reading ``node`` within ``depth`` steps (a refined selection reaches its
    attention through ``refine_selection`` and a ``getitem``)."""
    seen, frontier = [], [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen += frontier
    return seen


def _target_name(target) -> str | None:
    """``specontext::NAME`` for our ops, ``module.NAME`` for our step functions (a wrapper made
    with ``functools.wraps`` reads as the function), else None."""
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "overloadpacket", None),
                                                                "_qualified_op_name", None)
    if name is not None or not callable(target):
        return name
    target = inspect.unwrap(target)
    module = getattr(target, "__module__", "") or ""
    return f"{module.rsplit('.', 1)[-1]}.{target.__name__}" if module.startswith("specontext_compile") else None


def _step_calls(index: int, report: CompileReport) -> str:
    """The decode step's calls in graph order, counted: our ops (``specontext::``, each an
    op in the rewritten graph) and the step functions the passes call directly (module and
    name), then what the lowering did (ops replaced by their aten bodies, pairs fused, ops
    kept and why)."""
    calls: dict[str, int] = {}
    for node in report.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = _target_name(node.target)
        if name is not None and name.startswith(("specontext::", "aten_step.", "scorers.", "offload_step.", "page_bounds.",
                                                 "mla.")):
            calls[name] = calls.get(name, 0) + 1
    text = ", ".join(f"{k} x{v}" for k, v in calls.items())
    if report.result.routes:  # the pass's one decision per site (runtime/routes.py)
        text += "; routes: " + ", ".join(f"{route} x{n}" for route, n in sorted(report.result.routes.items()))
        text += "".join(f" ({n} not on the kernel: {why})" for why, n in sorted(report.result.route_reasons.items()))
        if report.result.cpu_kernel_sites:
            text += f"; our CPU kernel at {report.result.cpu_kernel_sites} site(s)"
    lowered = report.lowered
    if lowered is not None:
        text += (f"; lowered to aten: {sum(lowered.lowered.values())} op nodes, {lowered.fused} refine+attend "
                 f"pairs fused; kept as ops: {', '.join(sorted(lowered.kept)) or 'none'}")
        if lowered.kernel or lowered.kernel_refused:
            text += (f"; generated Triton kernel at {lowered.kernel} site(s)"
                     + "".join(f", torch body at {n} ({why})" for why, n in lowered.kernel_refused.items()))
    return f"graph {index}: {text}"


def _selection_placement(index: int, gm: torch.fx.GraphModule) -> list[str]:
    nodes = list(gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    anchors = [n for n in nodes if is_op(n, ANCHOR)]
    writes = [n for n in nodes if is_op(n, KV_WRITE)]
    sparse = [n for n in nodes if n.target in _ATTENTION]
    out = []
    for sel in (n for n in nodes if is_op(n, scorers.head_select)):
        a = op_arguments(sel, scorers.head_select)
        window = a["variant"].sliding_window
        users = list(dict.fromkeys(u for u in _consumers(sel, depth=3) if u.target in _ATTENTION))
        first_sparse = min((where[u] for u in users), default=None)
        anchor = f"after {anchors[0].name} (node {where[anchors[0]]})" if anchors else "no anchor"
        first_write = f"before the first kv_write (node {where[writes[0]]})" if writes else ""
        out.append(
            f"graph {index}: {sel.name} ({_target_name(sel.target)}, head {a['head']}) at node {where[sel]} of {len(nodes)}, {anchor}, {first_write}; "
            f"window={window or 'full'}; feeds {len(users)} of {len(sparse)} sparse_attention nodes, "
            f"first at node {first_sparse}")
    return out


def explain(model: torch.nn.Module, example_inputs: Any, *, decode_steps: int = 1, **options: Any) -> Explanation:
    """Compile ``model.forward`` with the specontext backend, run a prefill on
    ``example_inputs`` and ``decode_steps`` greedy decode steps, and report what the pass did.

    Args:
        model: a Hugging Face causal LM (``forward(input_ids=..., cache=...)``).
        example_inputs: ``input_ids`` ``[batch, prompt_len]`` (a tensor) or a dict of
            ``forward`` keyword arguments holding ``input_ids``.
        decode_steps: decode steps to run after the prefill (>= 1 to see a decode graph).
        **options: backend options (see :class:`SpeContextConfig`), e.g. ``budget`` or
            ``dump_dir`` for graph dumps.

    Returns:
        An :class:`Explanation`; ``print(explanation.table())`` for the table.

    Raises:
        ValueError: for unknown options or bad values, or inputs without ``input_ids``.
    """
    SpeContextConfig.from_options(options)
    kwargs = dict(example_inputs) if isinstance(example_inputs, dict) else {"input_ids": example_inputs}
    input_ids = kwargs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("explain needs input_ids, a [batch, prompt_len] tensor")
    if decode_steps < 0:
        raise ValueError(f"decode_steps must be >= 0, got {decode_steps}")
    before = {id(r) for r in compile_reports()}
    start = dict(counters["specontext"])
    config = SpeContextConfig.from_options(options)  # options flat or grouped
    forward = torch.compile(model.forward, backend="specontext", options=options)
    cache = SpeContextCache(model.config, max_cache_len=input_ids.shape[1] + decode_steps + 1,
                            retrieval_head=config.selection.retrieval_head)
    manager = None
    if config.offload.device_memory_bytes is not None:  # KV offload: show the memory model's plan
        from .runtime.offload import enable_offload

        manager = enable_offload(cache, model, config.offload.device_memory_bytes, config.buffer_tokens,
                                 resident_layers=config.selection.dense_layers)
    with torch.no_grad():
        logits = forward(input_ids=input_ids, cache=cache, use_cache=True, **kwargs).logits
        for _ in range(decode_steps):
            nxt = logits[:, -1:].argmax(-1)
            logits = forward(input_ids=nxt, cache=cache, use_cache=True).logits
    reports = [r for r in compile_reports() if id(r) not in before]
    rows, selections, heads, steps = [], [], [], []
    for index, report in enumerate(reports):
        if report.result.phase == "decode":
            heads.append(f"graph {index}: {_head_text(report)}")
            steps.append(_step_calls(index, report))
        for site in report.result.sites:
            rows.append(SiteRow(
                graph=index, phase=report.result.phase, layer=site.layer, pattern=site.pattern,
                heads=site.num_heads, kv_heads=site.num_kv_heads, head_dim=site.head_dim,
                q_len=site.q_len, window=site.window, soft_cap=site.soft_cap,
                rewritten=site.reason is None, reason=site.reason))
        selections += _selection_placement(index, report.graph_module)
    delta = {k: v - start.get(k, 0) for k, v in counters["specontext"].items() if v - start.get(k, 0)}
    # what the compiled step counted itself (also when inductor runs it: no Python op calls)
    delta.update({f"step.{k}": v for k, v in cache.path_counts().items() if v})
    return Explanation(rows, delta, selections, [r.pass_uuid for r in reports], heads, reports,
                       _offload_plan(manager), steps)


def _offload_plan(manager) -> dict[str, Any] | None:
    """The memory model's plan of an offload run: its description (device size, weights,
    KV row bytes, thresholds ``ST[i]``), the thresholds, and per decode step the length,
    layers offloaded, expected device bytes and bytes moved."""
    if manager is None or manager.model is None:
        return None
    return {"model": manager.model.describe(manager.device_memory_bytes),
            "thresholds": manager.summary()["thresholds"],
            "steps": [dataclasses.asdict(s) | {"per_layer_rows": None} for s in manager.stats]}


def _head_text(report: CompileReport) -> str:
    """Which retrieval head drives the selection of ``report``'s graph, in words."""
    result = report.result
    if result.selection_head.startswith("draft:"):
        from .runtime.draft_retrieval import head_spec

        text = head_spec(result.selection_head.split(":", 1)[1]).describe()
    else:
        text = f"lagged query of layers {','.join(map(str, result.retrieval_layers))} (training-free)"
    return text if result.selection_inserted else f"{text}; no selection inserted"

