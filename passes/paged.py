"""The rewrite of a continuous-batching step (Hugging Face's paged, packed KV; issue 28).

Matches, in the one graph of a step of Hugging Face's continuous batching (its cache update
made traceable: ``specontext_compile.serving``), every attention site of the form

    key_view.index_copy_(0, write_index, key)            # the engine's KV write
    keys = index_select(key_view, 0, read_index) ...      # every request's history, packed
    scaled_dot_product_attention(query, keys..., values..., attn_mask=mask, scale=s)

(``key_view`` / ``value_view`` / ``write_index`` / ``read_index`` / ``mask`` graph inputs),
and rewrites the step as :mod:`..runtime.paged` describes, in three variants the backend
compiles side by side and picks per step: the *decode* variant (one
:func:`~..runtime.paged.packed_select` before the first KV write, each site's attention
replaced by :func:`~..runtime.paged.packed_sparse_attention`; the dense attention's gathers
go with it), the *mixed* variant (both attentions, the sparse one on decode rows) and the
*dense* variant (Hugging Face's attention unchanged); all with a
:func:`~..runtime.paged.record_packed_query` in each retrieval layer.

Invariants: a graph that does not have exactly this form is left as it is (dense, exact)
with the reason returned; the cache layout (page size, layers, blocks) is derived from the
views' shapes and checked against every site; the KV writes are never moved.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from ..config import SpeContextConfig, default_retrieval_layers
from ..runtime import paged, paged_bounds
from ..runtime.page_bounds import PAGE_TOKENS
from ..runtime.paged_bounds import PagedLayout
from ..runtime.spec import StepSpec
from .sites import static_int

logger = logging.getLogger(__name__)

__all__ = ["PagedLayout", "PagedRewrite", "PagedSite", "rewrite_paged"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_STATE = ("specontext_paged_queries", "specontext_paged_stamps", "specontext_paged_stats", "specontext_paged_page_min",
          "specontext_paged_page_max", "specontext_paged_chunk_rows")


@dataclasses.dataclass
class PagedSite:
    """One attention site of a continuous-batching step (graph nodes)."""

    attention: fx.Node
    query: fx.Node
    key_view: fx.Node
    value_view: fx.Node
    read_index: fx.Node
    write_index: fx.Node
    write: fx.Node
    mask: fx.Node
    scale: float


@dataclasses.dataclass
class PagedRewrite:
    """What :func:`rewrite_paged` did: the sites, the layout, the retrieval layers and the
    state's shape, or the reason the graph was left dense (``reason``)."""

    sites: list[PagedSite] = dataclasses.field(default_factory=list)
    layout: PagedLayout | None = None
    retrieval_layers: tuple[int, ...] = ()
    num_heads: int = 0
    head_dim: int = 0
    key_input: int = -1  # the position, among the graph's inputs, of layer 0's key view
    mask_input: int = -1  # ... of the attention mask
    read_input: int = -1  # ... of read_index
    write_input: int = -1  # ... of write_index
    keep_input: int = -1  # ... of logits_to_keep (-1: the graph has none)
    spec: StepSpec | None = None  # the sites' step spec (:func:`step_spec`)
    reason: str | None = None

    @property
    def rewritten(self) -> bool:
        return self.reason is None and bool(self.sites)


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _is_index_select(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.index_select, torch.ops.aten.index_select.default)
            or node.op == "call_method" and node.target == "index_select")


def _gathered_view(node: fx.Node, depth: int = 12) -> tuple[fx.Node, fx.Node] | None:
    """``(view, read_index)`` of the ``index_select(view, 0, read_index)`` that ``node`` (an
    attention operand) is a reshaping of, both graph inputs; else None."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return None
        if _is_index_select(node):
            view, dim, index = node.args[:3]
            ok = dim == 0 and all(isinstance(n, fx.Node) and n.op == "placeholder" for n in (view, index))
            return (view, index) if ok else None
        node = node.args[0] if node.args else None
    return None


def _write_of(view: fx.Node) -> fx.Node | None:
    """The ``view.index_copy_(0, write_index, rows)`` of a cache view, or None."""
    for user in view.users:
        if (user.op == "call_method" and user.target == "index_copy_" and user.args[0] is view
                and user.args[1] == 0 and isinstance(user.args[2], fx.Node)):
            return user
    return None


def _site(node: fx.Node) -> tuple[PagedSite | None, str | None]:
    """The site of an SDPA node, or the reason it is not a paged site (None, None: not one at all)."""
    args = list(node.args) + [None] * (4 - len(node.args))
    query, keys, values = args[:3]
    mask = node.kwargs.get("attn_mask", args[3])
    key_src, value_src = _gathered_view(keys), _gathered_view(values)
    if key_src is None or value_src is None:
        return None, None
    if key_src[1] is not value_src[1]:
        return None, "keys and values are gathered with different read indices"
    if node.kwargs.get("is_causal", False) or node.kwargs.get("dropout_p", 0.0) or node.kwargs.get("enable_gqa"):
        return None, "attention is causal, has dropout or enable_gqa (not the continuous-batching form)"
    if not (isinstance(mask, fx.Node) and mask.op == "placeholder"):
        return None, "the attention mask is not a graph input"
    write, value_write = _write_of(key_src[0]), _write_of(value_src[0])
    if write is None or value_write is None or write.args[2] is not value_write.args[2]:
        return None, "no KV write with one write index into the gathered views"
    if write.args[2].op != "placeholder":
        return None, "the write index is not a graph input"
    q = _val(query)
    if q is None or q.dim() != 4 or q.shape[0] != 1:
        return None, "the query is not [1, heads, tokens, head_dim]"
    scale = node.kwargs.get("scale")
    scale = float(q.shape[-1]) ** -0.5 if scale is None else scale
    if not isinstance(scale, (int, float)):
        return None, "the softmax scale is not a constant"
    return PagedSite(node, query, key_src[0], value_src[0], key_src[1], write.args[2], write, mask, float(scale)), None


def _layout(sites: list[PagedSite]) -> tuple[PagedLayout | None, str | None]:
    """The cache layout from the views' row counts: layer ``i``'s key view starts ``2 i P``
    rows into the cache, its value view ``(2 i + 1) P``."""
    # the layout sizes the backend's host-side state (PagedState): a row count dynamo made
    # symbolic (a second engine of another size) is guarded to its value (int() of a SymInt),
    # so this graph serves this cache size only and another size compiles its own
    rows = [(int(_val(s.key_view).shape[0]), int(_val(s.value_view).shape[0])) for s in sites]
    total, page = rows[0][0], rows[0][0] - rows[0][1]
    if page <= 0:
        return None, "the cache views do not look like Hugging Face's paged layout"
    for i, (k, v) in enumerate(rows):
        if (k, v) != (total - 2 * i * page, total - (2 * i + 1) * page):
            return None, (f"layer {i}'s cache views ({k}, {v} rows) do not follow the paged layout of "
                          f"page size {page} (several layer groups, e.g. sliding-window layers, are not built)")
    layout = PagedLayout(page, len(sites), total // (2 * page * len(sites)))
    if total % layout.stride:
        return None, f"{total} cache rows are not whole blocks of {layout.stride}"
    return layout, None


def _shared(sites: list[PagedSite]) -> str | None:
    first = sites[0]
    for s in sites[1:]:
        if s.read_index is not first.read_index or s.write_index is not first.write_index or s.mask is not first.mask:
            return "sites read different masks or indices (several layer groups are not built)"
    heads = {(_val(s.query).shape[1], _val(s.query).shape[-1], _val(s.key_view).shape[1]) for s in sites}
    if len(heads) != 1:
        return "layers differ in heads or head_dim"
    if len({s.scale for s in sites}) != 1:
        return "layers differ in their softmax scale"
    return None


def find_paged_sites(graph: fx.Graph) -> tuple[list[PagedSite], str | None]:
    """Every paged site of ``graph`` in order, or ``([], reason)``."""
    sites, reasons = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            site, reason = _site(node)
            if site is not None:
                sites.append(site)
            elif reason is not None:
                reasons.append(reason)
    if reasons:
        return [], f"an attention site is not rewritable: {reasons[0]}"
    if not sites:
        return [], "no attention over a paged KV cache (index_copy_ / index_select / SDPA)"
    return sites, _shared(sites)


def _erase_gathers(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, recursively, its inputs that nothing else reads (the dense
    attention's gathers and reshapes; never a graph input or an in-place op)."""
    if node.users or node.op not in ("call_function", "call_method") or str(node.target).endswith("_"):
        return
    inputs = list(node.all_input_nodes)
    graph.erase_node(node)
    for inp in inputs:
        _erase_gathers(graph, inp)


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    out = []
    for name in _STATE:
        with graph.inserting_after(last):
            last = graph.placeholder(name)
        out.append(last)
    return out


def rewrite_paged(graph: fx.Graph, config: SpeContextConfig, kind: int, decode_rows: int | None = None
                  ) -> PagedRewrite:
    """Rewrite a continuous-batching step in place (module docstring) as the variant ``kind``
    (:data:`~..runtime.paged.SPARSE`: selection, sparse attention at every site;
    :data:`~..runtime.paged.MIXED`: both attentions, the sparse one on decode rows;
    :data:`~..runtime.paged.DENSE`: Hugging Face's attention, unchanged); every variant
    records the retrieval layers' queries, counts the step and, with the page rescue
    (:func:`step_spec`), recomputes after each KV write the bounds of the pages written
    (:func:`~..runtime.paged_bounds.update_bounds`). The mixed variant selects and
    attends sparsely for at most ``decode_rows`` rows (:func:`~..runtime.paged.decode_subset`;
    None: every query row). Six graph inputs are appended (the
    :class:`~..runtime.paged.PagedState` tensors, then the step's one-token prefill chunks,
    bool ``[Q]``: :func:`~..runtime.paged.decoding_rows`) when the graph is rewritten; else
    ``reason`` says why it was left as it is."""
    sites, reason = find_paged_sites(graph)
    if reason is not None:
        return PagedRewrite(reason=reason)
    layout, reason = _layout(sites)
    if reason is not None:
        return PagedRewrite(reason=reason)
    n = len(sites)
    picked = config.selection.retrieval_layers or default_retrieval_layers(n)
    retrieval = tuple(sorted({min(max(j + n if j < 0 else j, 0), n - 1) for j in picked}))
    q = _val(sites[0].query)
    inputs = [p for p in graph.nodes if p.op == "placeholder"]
    keep = [i for i, p in enumerate(inputs) if "logits_to_keep" in p.name]
    position = {node: i for i, node in enumerate(inputs)}
    result = PagedRewrite(sites, layout, retrieval, q.shape[1], q.shape[-1], position[sites[0].key_view],
                          position[sites[0].mask], position.get(sites[0].read_index, -1),
                          position.get(sites[0].write_index, -1), keep[0] if len(keep) == 1 else -1)
    queries, stamps, stats, page_min, page_max, chunk = _placeholders(graph)
    spec = result.spec = step_spec(config, layout)
    first_write = min((s.write for s in sites), key=list(graph.nodes).index)
    subset = None
    with graph.inserting_before(first_write):
        if spec.rescue_pages:  # the pages this step writes: their bounds are recomputed at every layer
            plan = graph.call_function(paged_bounds.write_plan, (
                sites[0].write_index, sites[0].mask, layout, layout.pages(spec.page_tokens), spec.page_tokens))
        if kind != paged.DENSE:
            mask = sites[0].mask
            if kind == paged.MIXED:  # decode rows only: (index, mask, slot, decode)
                tokens = static_int(q.shape[2])  # symbolic without the engine's padding: never a constant
                rows = decode_rows if tokens is None else min(tokens, decode_rows or tokens)
                if rows is None:
                    rows = graph.call_method("size", (mask, 2))
                found = graph.call_function(paged.decode_subset, (mask, rows, chunk))
                subset = [graph.call_function(operator.getitem, (found, i)) for i in range(4)]
                mask = subset[1]
            selected = graph.call_function(paged.packed_select, (
                queries, stamps, [sites[i].key_view for i in retrieval], sites[0].read_index, mask,
                spec, sites[0].scale, layout.stride))
            columns, recency, last, decode = (graph.call_function(operator.getitem, (selected, i)) for i in range(4))
            if spec.rescue_pages:  # what every layer's rescue reads from the step
                rescue = graph.call_function(paged_bounds.rescue_plan, (
                    columns, sites[0].read_index, mask, spec.page_tokens, layout))
            if subset is not None:  # the recording reads every row's last flag
                last = graph.call_function(paged.last_rows, (sites[0].mask,))
            graph.call_function(paged.count_paged_step, (stats, kind, n, recency, spec))
        else:
            last = graph.call_function(paged.last_rows, (sites[0].mask,))
            graph.call_function(paged.count_paged_step, (stats, kind, n))
    for slot, layer in enumerate(retrieval):
        site = sites[layer]
        with graph.inserting_before(site.attention):
            graph.call_function(paged.record_packed_query, (
                queries, stamps, slot, site.query, site.write_index, last, layout.stride))
    bounds = []
    for i, site in enumerate(sites if spec.rescue_pages else ()):
        with graph.inserting_before(site.write.next):
            layer = tuple(graph.call_function(operator.getitem, (state, i)) for state in (page_min, page_max))
            graph.call_function(paged_bounds.update_bounds, (layer, site.key_view, plan))
        bounds.append(layer)
    for i, site in enumerate(sites if kind != paged.DENSE else ()):
        _attend_selected(graph, site, columns, subset, spec, (rescue, bounds[i]) if bounds else None)
    graph.lint()
    return result


def step_spec(config: SpeContextConfig, layout: PagedLayout) -> StepSpec:
    """The step's :class:`StepSpec`: the config's, with the page rescue's pages of
    :data:`~..runtime.page_bounds.PAGE_TOKENS` tokens (as one request's store) when they
    divide the engine's ``page_size``; else without the rescue (a page would straddle two
    blocks; the backend logs it)."""
    spec = StepSpec.from_config(config)
    return spec.for_store(0 if layout.page_size % PAGE_TOKENS else PAGE_TOKENS)


def _attend_selected(graph: fx.Graph, site: PagedSite, columns: fx.Node, subset: list[fx.Node] | None,
                     spec: StepSpec, rescue: tuple | None) -> None:
    """Replace the site's dense attention by :func:`~..runtime.paged.packed_sparse_attention`
    over ``columns`` (when ``spec.refines``, more candidates than the budget or the page
    rescue: :func:`~..runtime.paged.packed_refine_attention`, each layer keeping its own
    budget of them, after :func:`~..runtime.paged_bounds.packed_rescue` when ``rescue`` =
    ``(plan, (page_min, page_max))`` is given) and erase the dense attention's
    gathers; with ``subset`` (a mixed step's decode rows,
    :func:`~..runtime.paged.decode_subset`) attend sparsely for those rows only and keep the
    dense attention for the others (:func:`~..runtime.paged.mixed_attention`)."""
    query = site.query
    with graph.inserting_before(site.attention):
        if subset is not None:
            query = graph.call_function(torch.index_select, (site.query, 2, subset[0]))
        if rescue is not None:
            plan, bounds = rescue
            columns = graph.call_function(paged_bounds.packed_rescue, (query, columns, plan, bounds, spec, site.scale))
        args = (query, site.key_view, site.value_view, site.read_index, columns, site.scale)
        if spec.refines:
            out = graph.call_function(paged.packed_refine_attention, (*args, spec))
        else:
            out = graph.call_function(paged.packed_sparse_attention, args)
        if subset is not None:
            out = graph.call_function(paged.expand_decode_rows, (out, subset[2]))
    if subset is not None:
        with graph.inserting_after(site.attention):
            mixed = graph.call_function(paged.mixed_attention, (out, site.attention, subset[3]))
        site.attention.replace_all_uses_with(mixed, delete_user_cb=lambda user: user is not mixed)
        return
    out.meta.update({k: v for k, v in site.attention.meta.items() if k in ("example_value", "val", "stack_trace")})
    keys, values = site.attention.args[1:3]
    site.attention.replace_all_uses_with(out)
    graph.erase_node(site.attention)
    _erase_gathers(graph, keys)
    _erase_gathers(graph, values)
