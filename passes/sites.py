"""Find attention sites and their KV-cache writes in a dynamo FX graph (torch-level ops).

A *site* is one attention call. It is *matched* when its key and value provably read the
whole store of one ``specontext::kv_write`` (directly, or through Hugging Face's exact
``repeat_kv`` expansion), its constants are the ones sparse attention reproduces (no dropout,
no causal flag for decode, a known scale), and its query has a static length. Anything else
keeps exact dense attention and gets a reason string. Constants are checked, never
wildcarded: a different expansion or softmax dimension must not match.

Recognised spellings (normalised here, matched once): SDPA (also with one KV head broadcast
over every query head, multi-query attention), and written-out softmax attention
``softmax(cap * tanh((q @ k^T * s) / cap) + mask) @ v`` where the scale is a constant
multiplication or division, the soft cap (Gemma 2) and the additive float mask are
optional, and a dtype cast (``.to``/``.type``) and an identity dropout may follow the softmax.
Each layer's sliding window is read from the ``retrieval_anchor`` node (constants written by
``SpeContextCache``), never guessed from the mask.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from ..runtime import ops as _ops  # noqa: F401  (registers the specontext:: ops used below)
from ..runtime.protocol import RetrievalAnchor, is_op
from ..runtime.torch_private import C_LINEAR, C_SDPA

__all__ = ["SDPA_TARGETS", "AttentionSite", "static_int", "decoder_layer_outputs", "find_attention_sites",
           "find_token_embedding", "is_op", "layer_windows"]

SDPA_TARGETS = (torch.nn.functional.scaled_dot_product_attention, C_SDPA)
KV_WRITE = torch.ops.specontext.kv_write
ANCHOR = torch.ops.specontext.retrieval_anchor
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FULL = slice(None, None, None)


@dataclasses.dataclass
class MLAExpansion:
    """How a multi-head latent attention site builds its keys/values from its two stores
    (Hugging Face's ``expand_kv``): ``weight`` is ``kv_b_proj.weight`` ``[heads * (nope_dim +
    value_dim), kv_lora_rank]``; ``scratch`` the nodes that fill the per-head key tensor
    (its two slice copies), removed with the site (they would up-project the whole store)."""

    weight: fx.Node
    nope_dim: int
    value_dim: int
    rope_dim: int
    scratch: list[fx.Node]
    latent_query: fx.Node | None = None  # set by the rewrite


@dataclasses.dataclass
class AttentionSite:
    """One attention call in the graph.

    ``layer`` is the position of its KV write among all writes (graph order, i.e. decoder
    layer order), set whenever the store was resolved (even if the site stays dense);
    ``window`` is that layer's sliding window from the retrieval anchor (0 = full causal);
    ``soft_cap`` the logit soft cap of a written-out site; ``reason`` is None when the site
    can be rewritten.
    """

    node: fx.Node
    query: fx.Node | None = None
    attn_mask: fx.Node | None = None
    scale: float | None = None
    write: fx.Node | None = None
    layer: int | None = None
    q_len: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    pattern: str = "sdpa"
    soft_cap: float | None = None
    window: int | None = None  # 0 = full, w > 0 = sliding window, -1 = other, None = unknown
    mla: MLAExpansion | None = None  # multi-head latent attention (key/value stores = latent/rope)
    position_bias: fx.Node | None = None  # additive per-head bias over key positions (ALiBi), 3-D
    sinks: fx.Node | None = None  # learned sink logit per query head (GPT-OSS), [num_heads]
    reason: str | None = None

    @property
    def query_width(self) -> int | None:
        """Width of the query the site records for the selection: its head size, or for an
        MLA site the absorbed query's (``kv_lora_rank + rope``, :mod:`..runtime.mla`)."""
        if self.mla is None:
            return self.head_dim
        weight = example_value(self.mla.weight)
        return None if weight is None else weight.shape[-1] + self.mla.rope_dim

    @property
    def key_cache(self) -> fx.Node:
        return self.write.args[0]

    @property
    def value_cache(self) -> fx.Node:
        return self.write.args[1]

    @property
    def length(self) -> fx.Node:
        return self.write.args[2]


WEIGHTS_USED = ("the attention weights leave the attention (output_attentions=True returns them, or the model "
                "reads its scores elsewhere): dense and exact, so the returned weights are the model's")


def example_value(node) -> torch.Tensor | None:
    """A node's example value (dynamo keeps it as ``example_value``, AOTAutograd as ``val``),
    or None for a constant or a node without one."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def static_int(x) -> int | None:
    """``x`` as an int when it is one, or a ``SymInt`` that dynamo's guards already pin to a
    constant (its shape environment replaced the symbol: e.g. a size automatic dynamic shapes
    made symbolic, then ``Eq(s0, 32)`` was guarded); None when it is truly symbolic."""
    if isinstance(x, torch.SymInt):
        return x.node.maybe_as_int()
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _sdpa_args(node: fx.Node) -> dict:
    bound = dict(zip(_SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _strip_repeat_kv(node: fx.Node) -> tuple[fx.Node, int]:
    """Undo HF ``repeat_kv``: ``x[:, :, None, :, :].expand(b, h, g, s, d).reshape(b, h*g, s, d)``.

    Returns the source node and the group count (1 when there is no expansion). Any other
    view chain is returned unchanged (and then fails to match a KV store).
    """
    if not (node.op == "call_method" and node.target == "reshape"):
        return node, 1
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return node, 1
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return node, 1
    if index.args[1] != (_FULL, _FULL, None, _FULL, _FULL):
        return node, 1
    src, out, exp = index.args[0], example_value(node), example_value(expand)
    src_val = example_value(src)
    if src_val is None or out is None or exp is None or src_val.dim() != 4:
        return node, 1
    b, h, s, d = src_val.shape
    g = exp.shape[2]
    if tuple(exp.shape) != (b, h, g, s, d) or tuple(out.shape) != (b, h * g, s, d):
        return node, 1
    return src, g


def _strip_prefix_slice(node: fx.Node) -> fx.Node:
    """Undo HF SDPA's prefill crop ``x[:, :, :n, :]`` (a prefix of the store)."""
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        if (isinstance(index, tuple) and len(index) == 4 and index[0] == _FULL and index[1] == _FULL
                and index[3] == _FULL and isinstance(index[2], slice)
                and index[2].start is None and index[2].step is None):
            return node.args[0]
    return node


def first_layer(graph: fx.Graph) -> int:
    """Index (among the model's KV layers) of the graph's first KV write: the ``layer`` of
    its first retrieval anchor (a graph after a graph break starts past layer 0), else 0."""
    anchor = RetrievalAnchor.first(graph)
    return RetrievalAnchor.of(anchor).layer if anchor is not None else 0


def _writes_by_store(graph: fx.Graph) -> tuple[dict, dict]:
    writes = [n for n in graph.nodes if is_op(n, KV_WRITE)]
    offset = first_layer(graph)
    by_key = {w.args[0]: (offset + i, w) for i, w in enumerate(writes)}
    by_value = {w.args[1]: (offset + i, w) for i, w in enumerate(writes)}
    return by_key, by_value


def layer_windows(graph: fx.Graph) -> dict[fx.Node, int]:
    """Sliding window of each KV write that follows the graph's first retrieval anchor: the
    anchor's ``layer_windows`` constant, in write order from the anchor's layer. Empty when
    there is no anchor or it carries no windows."""
    anchor = RetrievalAnchor.first(graph)
    if anchor is None:
        return {}
    anchored = RetrievalAnchor.of(anchor)
    windows = anchored.windows()
    if windows is None:
        return {}
    windows = windows[anchored.layer:]
    out, seen = {}, False
    for n in graph.nodes:
        seen = seen or n is anchor
        if seen and is_op(n, KV_WRITE):
            if len(out) >= len(windows):
                return {}  # more writes than decoder layers: do not guess
            out[n] = windows[len(out)]
    return out


def _reads_store(node: fx.Node, stores: set, depth: int = 12) -> bool:
    """Whether ``node`` is computed from one of ``stores`` within ``depth`` steps."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in stores:
                return True
            if n in seen:
                continue
            seen.add(n)
            nxt += [a for a in n.all_input_nodes]
        frontier = nxt
    return False


def _resolve_store(site: AttentionSite, args: dict, by_key: dict, by_value: dict, order: dict,
                   windows: dict) -> str | None:
    """Find the KV write whose stores the site reads; returns a reason when there is none."""
    key_src, kg = _strip_repeat_kv(_strip_prefix_slice(args["key"]))
    value_src, vg = _strip_repeat_kv(_strip_prefix_slice(args["value"]))
    mla = _match_mla_expansion(key_src, value_src, {site.node, args["key"]}, by_key, by_value)
    if isinstance(mla, tuple):
        key_src, value_src, site.mla = mla
        site.pattern += "+mla"
        kg = vg = static_int(example_value(site.query).shape[1]) if example_value(site.query) is not None else None
    if key_src not in by_key or value_src not in by_value:
        stores = set(by_key) | set(by_value)
        if stores and (_reads_store(args["key"], stores) or _reads_store(args["value"], stores)):
            return ("key/value are computed from the KV store by other ops (an unrecognised "
                    "expansion, or an up-projection of a latent cache as in MLA): not rewritten")
        return "key/value do not come from a SpeContextCache store (use cache=SpeContextCache(...))"
    layer, write = by_key[key_src]
    if by_value[value_src][1] is not write:
        return "key and value come from different KV writes"
    if order[write] > order[site.node]:
        return "KV write happens after the attention"
    site.num_kv_heads = static_int(example_value(key_src).shape[1])
    q = example_value(site.query)
    site.num_heads = static_int(q.shape[1]) if q is not None and q.dim() == 4 else None
    groups = kg
    if args.get("enable_gqa", False) and site.num_heads and site.num_kv_heads:
        groups = site.num_heads // site.num_kv_heads
    elif kg == vg == 1 and site.num_kv_heads == 1 and site.num_heads:
        groups = site.num_heads  # multi-query: one KV head broadcast over every query head
    if site.num_kv_heads is None or site.num_heads is None:
        return "the number of query or KV heads is symbolic (dynamic shapes): not rewritten"
    if site.mla is not None and q.shape[-1] != site.mla.nope_dim + site.mla.rope_dim:
        return f"MLA query is {q.shape[-1]} wide, not nope {site.mla.nope_dim} + rope {site.mla.rope_dim}"
    if site.mla is not None and site.mla.nope_dim < 1:  # the attention op reads an MLA site by nope_dim > 0
        return "MLA without a no-position query part (qk_nope_head_dim 0) is not built: dense and exact"
    if kg != vg or site.num_kv_heads * groups != site.num_heads:
        return f"head mapping is not GQA: {site.num_heads} query heads, {site.num_kv_heads} KV heads x {kg}"
    site.write, site.layer = write, layer
    site.window = windows.get(write)
    if site.window is not None and site.window < 0:
        return "the layer's attention is neither full causal nor sliding-window (cache layer type)"
    return None


def _slice_copy(node: fx.Node, expected: slice) -> tuple[fx.Node, fx.Node] | None:
    """``(copy_, source)`` when ``node`` is ``x[..., expected]`` used only by ``.copy_(source)``."""
    if not (_is_call(node, (operator.getitem,)) and node.args[1] == (Ellipsis, expected)):
        return None
    users = list(node.users)
    if len(users) != 1 or not _is_call(users[0], method="copy_") or users[0].args[0] is not node:
        return None
    return users[0], users[0].args[1]


def _match_mla_expansion(key: fx.Node, value: fx.Node, readers: set, by_key: dict, by_value: dict):
    """Hugging Face's MLA ``expand_kv`` (DeepSeek-V2/V3 and relatives), checked node by node::

        up = linear(latent_store, W, None).view(b, cap, heads, nope + v).transpose(1, 2)
        k_nope, value = split(up, [nope, v], dim=-1)
        key = up.new_empty(b, heads, cap, nope + rope)
        key[..., :nope].copy_(k_nope); key[..., nope:].copy_(rope_store.expand(-1, heads, -1, -1))

    Returns ``(latent_store, rope_store, MLAExpansion)``, or None when this is not that
    spelling (then the site is matched, or refused, as any other). ``readers``: the site and
    the node it reads the key through (a prefill crop), which may also use ``key``."""
    if not (_is_call(key, method="new_empty") and isinstance(value, fx.Node)):
        return None
    consumers = [u for u in key.users if u not in readers and _transposed_key(u) is None]
    copies = [u for u in consumers if _is_call(u, (operator.getitem,))]
    if len(copies) != 2 or len(consumers) != 2:
        return None
    if not _is_call(value, (operator.getitem,)) or value.args[1] != 1:
        return None
    split = value.args[0]
    if not (_is_call(split, (torch.functional.split, torch.split), method="split")):
        return None
    sizes, dim = _arg(split, 1, "split_size_or_sections"), _arg(split, 2, "dim", 0)
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and all(isinstance(x, int) for x in sizes)
            and dim in (-1, 3)):
        return None
    nope, v_dim = sizes
    nope_copy = _slice_copy(copies[0], slice(None, nope, None)) or _slice_copy(copies[1], slice(None, nope, None))
    rope_copy = _slice_copy(copies[0], slice(nope, None, None)) or _slice_copy(copies[1], slice(nope, None, None))
    if nope_copy is None or rope_copy is None:
        return None
    k_nope = nope_copy[1]
    if not (_is_call(k_nope, (operator.getitem,)) and k_nope.args == (split, 0)):
        return None
    up = split.args[0]
    if not (_is_call(up, (torch.transpose,), method="transpose") and {d % 4 for d in up.args[1:]} == {1, 2}):
        return None
    view = up.args[0]
    if not (_is_call(view, method="view") or _is_call(view, method="reshape")):
        return None
    linear = view.args[0]
    if not (_is_call(linear, (C_LINEAR, torch.nn.functional.linear)) and len(linear.args) >= 2
            and _arg(linear, 2, "bias") is None):
        return None
    latent, weight = linear.args[0], linear.args[1]
    expand = rope_copy[1]
    if not (_is_call(expand, method="expand") and isinstance(expand.args[0], fx.Node)):
        return None
    rope = expand.args[0]
    if latent not in by_key or rope not in by_value or by_key[latent][1] is not by_value[rope][1]:
        return None
    lat, rp, w, up_val, key_val = example_value(latent), example_value(rope), example_value(weight), example_value(up), example_value(key)
    if any(x is None for x in (lat, rp, w, up_val, key_val)) or lat.dim() != 4 or rp.dim() != 4:
        return None
    b, one, cap, r = lat.shape
    heads = up_val.shape[1]
    rope_dim = rp.shape[-1]
    if not (one == 1 and rp.shape[:3] == lat.shape[:3] and tuple(w.shape) == (heads * (nope + v_dim), r)
            and tuple(up_val.shape) == (b, heads, cap, nope + v_dim)
            and tuple(key_val.shape) == (b, heads, cap, nope + rope_dim)
            and tuple(example_value(expand).shape) == (b, heads, cap, rope_dim)):
        return None
    scratch = [nope_copy[0], rope_copy[0]]
    return latent, rope, MLAExpansion(weight, nope, v_dim, rope_dim, scratch)


def _check_constants(site: AttentionSite, args: dict) -> str | None:
    """Reasons the site cannot become sparse attention (the store is already resolved)."""
    q = example_value(site.query)
    if args.get("dropout_p", 0.0) != 0.0:
        return f"dropout_p={args['dropout_p']} (sparse attention has no dropout)"
    site.q_len, site.head_dim = static_int(q.shape[2]), static_int(q.shape[3])
    if site.q_len is None or site.head_dim is None:
        return "query length or head_dim is dynamic (prefill graphs stay dense)"
    if args.get("is_causal", False) and site.q_len != 1:
        return f"prefill ({site.q_len} query tokens, is_causal=True): dense and exact by design"
    if _strip_prefix_slice(args["key"]) is not args["key"]:
        return "key is a cropped prefix of the store (prefill-style call)"
    scale = args.get("scale")
    if scale is not None:
        scale = _const_float(example_value(scale) if isinstance(scale, fx.Node) else scale)
        if scale is None:
            return "scale is not a constant"
    site.scale = scale if scale is not None else site.head_dim**-0.5
    mask = site.attn_mask
    if mask is not None and (example_value(mask) is None or example_value(mask).dim() != 4):
        return "attention mask is not 4-D"
    return None


def _match_sdpa(site: AttentionSite, by_key: dict, by_value: dict, order: dict, windows: dict) -> None:
    args = _sdpa_args(site.node)
    site.query, site.attn_mask = args.get("query"), args.get("attn_mask")
    q = example_value(site.query)
    if q is None or q.dim() != 4:
        site.reason = "query has no 4-D example value"
        return
    site.reason = _resolve_store(site, args, by_key, by_value, order, windows) or _check_constants(site, args)


_SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)
_MATMUL = (torch.matmul, torch.Tensor.matmul, operator.matmul)


def _is_call(node, targets=(), method: str | None = None) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if method is not None and node.op == "call_method" and node.target == method:
        return True
    return node.op == "call_function" and node.target in targets


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _softmax_of(weights: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """Walk back from the attention weights through an identity dropout, a dtype cast and
    GPT-OSS's sink-column slice ``[..., :-1]`` (each at most once, in any order) to a softmax;
    returns it and the nodes passed."""
    chain, node, passed = [], weights, set()
    while True:
        if _is_call(node, (torch.nn.functional.dropout,)) and "dropout" not in passed:
            p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
            if p != 0.0 and training is not False:
                return None, chain
            passed.add("dropout")
        elif (_is_call(node, method="to") or _is_call(node, method="type")) and "cast" not in passed:
            passed.add("cast")
        elif (_is_call(node, (operator.getitem,)) and node.args[1] == (Ellipsis, slice(None, -1, None))
              and "sink" not in passed):
            passed.add("sink")
        else:
            break
        chain.append(node)
        node = node.args[0]
    if _is_call(node, _SOFTMAX, method="softmax"):
        return node, chain
    return None, chain


def _sink_logits(softmax_input: fx.Node, chain: list) -> tuple[fx.Node | None, fx.Node | None, str | None]:
    """GPT-OSS's sink column: ``softmax(cat([scores, sinks.reshape(1, -1, 1, 1).expand(b, -1, q,
    -1)], -1) [- its max])[..., :-1]``. Returns ``(scores, sinks [heads] node, None)``, or
    ``(None, None, reason)``; appends the nodes passed to ``chain``."""
    node = softmax_input
    if _is_call(node, (operator.sub,)) and len(node.args) == 2:
        top = node.args[1]
        peak = top.args[0] if _is_call(top, (operator.getitem,)) and top.args[1] == 0 else None
        if not (_is_call(peak, (torch.max,), method="max") and peak.args[0] is node.args[0]
                and _arg(peak, 1, "dim") in (-1, 3) and peak.kwargs.get("keepdim", False)):
            return None, None, "sink logits: the softmax input is not cat(...) minus its row max"
        chain += [node, top, peak]
        node = node.args[0]  # softmax(x - max x) == softmax(x)
    if not (_is_call(node, (torch.cat,)) and _arg(node, 1, "dim") in (-1, 3)
            and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 2):
        return None, None, "a column is sliced off the softmax, but it is not a concatenated sink column"
    scores, column = node.args[0]
    expand = column if _is_call(column, method="expand") else None
    view = expand.args[0] if expand is not None else None
    if not ((_is_call(view, method="reshape") or _is_call(view, method="view"))
            and tuple(view.args[1:]) == (1, -1, 1, 1)):
        return None, None, "the sink column is not one learned logit per head (reshape(1, -1, 1, 1))"
    sinks, sinks_val = view.args[0], example_value(view.args[0])
    if sinks_val is None or sinks_val.dim() != 1:
        return None, None, "the sink logits are not a 1-D per-head tensor"
    chain.append(node)
    return scores, sinks, None


def _const_float(x) -> float | None:
    """``x`` as a float when it is a number, or a ``SymFloat``/``SymInt`` pinned to a constant
    by dynamo's guards (see :func:`static_int`); None otherwise."""
    if isinstance(x, torch.SymFloat):
        return x.node.maybe_as_float()
    if isinstance(x, torch.SymInt):
        value = x.node.maybe_as_int()
        return None if value is None else float(value)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _scaled(node: fx.Node) -> tuple[fx.Node, float | None]:
    """``(x, s)`` when ``node`` is ``x * s``, ``s * x`` or ``x / c`` (``s = 1/c``) with a
    constant; ``(node, None)`` otherwise."""
    if _is_call(node, (operator.mul, torch.mul), method="mul") and len(node.args) == 2:
        a, b = node.args
        if _const_float(b) is not None and isinstance(a, fx.Node):
            return a, _const_float(b)
        if _const_float(a) is not None and isinstance(b, fx.Node):
            return b, _const_float(a)
    if (_is_call(node, (operator.truediv, operator.itruediv, torch.div), method="div")
            and len(node.args) == 2 and not node.kwargs and _const_float(node.args[1])):
        return node.args[0], 1.0 / _const_float(node.args[1])
    return node, None


def _soft_capped(node: fx.Node) -> tuple[fx.Node, float | None, list[fx.Node]]:
    """``(x, cap, nodes)`` when ``node`` is ``tanh(x / cap) * cap`` with one constant cap."""
    outer, cap = _scaled(node)
    if cap is None or not _is_call(outer, (torch.tanh,), method="tanh"):
        return node, None, []
    inner, inv = _scaled(outer.args[0])
    if inv is None or not (inv * cap == 1.0 or abs(inv * cap - 1.0) < 1e-12):
        return node, None, []
    return inner, cap, [node, outer, outer.args[0]]


def _added_mask(node: fx.Node) -> tuple[fx.Node, fx.Node | None, str | None]:
    """``(scores, mask, None)`` when ``node`` is ``scores + mask`` with a 4-D float mask,
    ``(node, None, None)`` when it is no such addition, ``(node, None, reason)`` when the
    added tensor is not an additive float mask."""
    if not (_is_call(node, (operator.add, torch.add)) and len(node.args) == 2 and not node.kwargs):
        return node, None, None
    scores, mask = node.args
    mask_val = example_value(mask) if isinstance(mask, fx.Node) else None
    if mask_val is None or mask_val.dim() != 4:
        return node, None, "the added mask is not a 4-D tensor"
    if not mask_val.dtype.is_floating_point:
        return node, None, f"a {mask_val.dtype} mask is added to the scores (not an additive float mask)"
    return scores, mask, None


def _sink_path_closed(nodes: set) -> bool:
    """Every user of the sink path's nodes is on the path or is its softmax (the logits feed
    both the row max and the subtraction)."""
    return all(all(u in nodes or _is_call(u, _SOFTMAX, method="softmax") for u in n.users) for n in nodes)


def _transposed_key(node) -> fx.Node | None:
    """``k`` when ``node`` is ``k.transpose(2, 3)`` of a 4-D ``k`` (any sign convention)."""
    if not (_is_call(node, (torch.transpose,), method="transpose") and len(node.args) == 3):
        return None
    dims = {d % 4 for d in node.args[1:] if isinstance(d, int)}
    return node.args[0] if dims == {2, 3} else None


def _match_eager(site: AttentionSite, by_key: dict, by_value: dict, order: dict, windows: dict) -> None:
    """``softmax(q @ k^T * scale + mask, dim=-1) @ v`` written out (HF "eager")."""
    site.pattern = "eager"
    weights, value = site.node.args[0], site.node.args[1]
    softmax, chain = _softmax_of(weights)
    dim = _arg(softmax, 1, "dim")
    if not isinstance(dim, int) or dim not in (-1, 3):
        site.reason = f"softmax over dim {dim}, not the key dimension"
        return
    dtype = softmax.kwargs.get("dtype", softmax.args[2] if len(softmax.args) > 2 else None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        site.reason = f"softmax dtype {dtype} is not a float dtype"
        return
    node, mask, scale = softmax.args[0], None, 1.0
    shared = set()  # nodes allowed several users (the sink path reads the logits twice)
    if any(_is_call(n, (operator.getitem,)) for n in chain):
        first = len(chain)
        node, site.sinks, site.reason = _sink_logits(node, chain)
        if site.reason is not None:
            return
        shared = set(chain[first:])
        site.pattern = "eager-sinks"
    added = node
    node, mask, site.reason = _added_mask(node)
    if site.reason is not None:
        return
    if mask is not None:
        chain.append(added)
    node, site.soft_cap, capped = _soft_capped(node)
    chain += capped
    scaled, factor = _scaled(node)
    if factor is not None:
        chain.append(node)
        node, scale = scaled, factor
    if not _is_call(node, _MATMUL):
        site.reason = "attention scores are not a plain q @ k^T product"
        return
    chain += [node, softmax]
    if any(len(n.users) != 1 for n in chain if n not in shared) or not _sink_path_closed(shared):
        site.reason = WEIGHTS_USED
        return
    key = _transposed_key(node.args[1])
    if key is None:
        site.reason = "key reaches the score product through another permutation"
        return
    site.query, site.attn_mask = node.args[0], mask
    args = {"key": key, "value": value}
    site.reason = _resolve_store(site, args, by_key, by_value, order, windows)
    if site.reason is None:
        site.reason = _check_constants(site, args)
        site.scale = scale


def _merged_heads(node) -> fx.Node | None:
    """``x`` when ``node`` is ``x.reshape(b * h, -1 | n, d)`` of a 4-D ``x`` ``[b, h, n, d]``
    (BLOOM's 3-D attention layout)."""
    if not (_is_call(node, method="reshape") or _is_call(node, method="view")):
        return None
    src, out = node.args[0], example_value(node)
    src_val = example_value(src)
    if src_val is None or out is None or src_val.dim() != 4 or out.dim() != 3:
        return None
    b, h, n, d = src_val.shape
    return src if tuple(out.shape) == (b * h, n, d) else None


def _match_baddbmm(site: AttentionSite, by_key: dict, by_value: dict, order: dict, windows: dict) -> None:
    """BLOOM's ALiBi attention in the 3-D layout::

        scores = bias.baddbmm(q.reshape(b*h, q, d), k.reshape(b*h, -1, d).transpose(-1, -2), beta=1, alpha=s)
        probs = softmax(scores.view(b, h, q, -1) + mask, dim=-1, dtype=float32).to(...)
        out = bmm(dropout(probs).view(b*h, q, -1), v.reshape(b*h, -1, d))

    ``bias`` (``[b*h, 1, capacity]``, one row per head, the same for every query row) is
    kept as the site's ``position_bias``: the sparse op adds it, gathered at the selected
    positions, like a mask, and the selection adds it to its scores."""
    site.pattern = "alibi-bmm"
    weights, value = site.node.args
    if _is_call(weights, method="view"):
        weights = weights.args[0]
    softmax, chain = _softmax_of(weights)
    dim = _arg(softmax, 1, "dim")
    if dim not in (-1, 3):
        site.reason = f"softmax over dim {dim}, not the key dimension"
        return
    node, mask, site.reason = _added_mask(softmax.args[0])
    if site.reason is not None:
        return
    if _is_call(node, method="view"):
        node = node.args[0]
    if not _is_call(node, (torch.baddbmm,), method="baddbmm"):
        site.reason = "3-D attention scores are not bias.baddbmm(q, k^T) (ALiBi, BLOOM's spelling)"
        return
    bias = node.args[0]
    q3, kt = _arg(node, 1, "batch1"), _arg(node, 2, "batch2")
    beta, alpha = node.kwargs.get("beta", 1.0), _const_float(node.kwargs.get("alpha", 1.0))
    key3 = kt.args[0] if _is_call(kt, (torch.transpose,), method="transpose") and \
        {d % 3 for d in kt.args[1:] if isinstance(d, int)} == {1, 2} else None
    query, key = _merged_heads(q3), _merged_heads(key3) if key3 is not None else None
    value4 = _merged_heads(value)
    bias_val = example_value(bias) if isinstance(bias, fx.Node) else None
    if beta != 1.0 or alpha is None or query is None or key is None or value4 is None:
        site.reason = "ALiBi scores: beta != 1, a non-constant scale, or q/k/v not reshaped from 4-D [b, h, n, d]"
        return
    q_val = example_value(query)
    b, h = q_val.shape[:2]
    if bias_val is None or bias_val.dim() != 3 or bias_val.shape[0] != b * h or bias_val.shape[1] != 1:
        site.reason = "the ALiBi bias is not one [batch * heads, 1, keys] row per head"
        return
    if any(len(n.users) != 1 for n in chain + [softmax]):
        site.reason = WEIGHTS_USED
        return
    site.query, site.attn_mask, site.position_bias = query, mask, bias
    args = {"key": key, "value": value4}
    site.reason = _resolve_store(site, args, by_key, by_value, order, windows)
    if site.reason is None:
        site.reason = _check_constants(site, args)
        site.scale = alpha
    if site.reason is None and bias_val.shape[-1] != example_value(site.key_cache).shape[-2]:
        site.reason = "the ALiBi bias does not span the KV store"


def find_attention_sites(graph: fx.Graph) -> list[AttentionSite]:
    """Every SDPA call and written-out softmax attention in ``graph``, matched against the
    KV writes (see module docstring)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key, by_value = _writes_by_store(graph)
    windows = layer_windows(graph)
    sites = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            site = AttentionSite(node=node)
            _match_sdpa(site, by_key, by_value, order, windows)
            sites.append(site)
        elif _is_call(node, _MATMUL) and _softmax_of(node.args[0])[0] is not None:
            site = AttentionSite(node=node)
            _match_eager(site, by_key, by_value, order, windows)
            sites.append(site)
        elif _is_call(node, (torch.bmm,), method="bmm") and isinstance(node.args[0], fx.Node) and _softmax_of(
                node.args[0].args[0] if _is_call(node.args[0], method="view") else node.args[0])[0] is not None:
            site = AttentionSite(node=node)
            _match_baddbmm(site, by_key, by_value, order, windows)
            sites.append(site)
    sites += _split_score_products(graph, by_key)
    sites += _other_value_products(graph, by_value, {s.node for s in sites})
    return sites


def _other_value_products(graph: fx.Graph, by_value: dict, seen: set) -> list[AttentionSite]:
    """Products ``weights @ values`` over a KV store that no recognised spelling claimed
    (e.g. weights rescaled or sliced after the softmax): counted as dense sites with a
    reason, so no attention goes unreported."""
    found = []
    for node in graph.nodes:
        if node in seen or not (_is_call(node, _MATMUL) or _is_call(node, (torch.bmm,), method="bmm")):
            continue
        if len(node.args) != 2 or not isinstance(node.args[1], fx.Node):
            continue
        value, _ = _strip_repeat_kv(_strip_prefix_slice(node.args[1]))
        if value not in by_value:
            continue
        site = AttentionSite(node=node, pattern="other")
        site.layer, site.write = by_value[value]
        weights = example_value(node.args[0])
        site.q_len = static_int(weights.shape[-2]) if weights is not None and weights.dim() >= 2 else None
        site.reason = ("attention weights over the KV store are not a recognised softmax (e.g. weights "
                       "rescaled or sliced after the softmax): dense and exact")
        found.append(site)
    return found


def _reaches_softmax(node: fx.Node, depth: int = 10) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        if any(_is_call(u, _SOFTMAX, method="softmax") for u in frontier):
            return True
    return False


def _split_score_products(graph: fx.Graph, by_key: dict) -> list[AttentionSite]:
    """Score products ``q @ store^T`` whose softmax is not in this graph: a graph break inside
    the attention (MPT compares ``cache.get_seq_length()``, a tensor for any preallocated
    cache, with Python's ``max``), so no graph holds a whole site. Counted as dense sites
    with that reason, so ``explain`` says why nothing was rewritten."""
    found = []
    for node in graph.nodes:
        if not _is_call(node, _MATMUL) or len(node.args) != 2:
            continue
        key = _transposed_key(node.args[1])
        if key is None or key not in by_key or _reaches_softmax(node):
            continue
        site = AttentionSite(node=node, query=node.args[0], pattern="split")
        site.layer, site.write = by_key[key]
        q = example_value(site.query)
        site.q_len = static_int(q.shape[-2]) if q is not None else None
        site.reason = ("the attention's scores over the KV store leave this graph before the softmax: a graph "
                       "break inside the attention (e.g. the model reads cache.get_seq_length() on the host); "
                       "dense and exact")
        found.append(site)
    return found


_EMBEDDING_TARGETS = (torch.nn.functional.embedding, torch.ops.aten.embedding.default)


def _is_embedding(node: fx.Node) -> bool:
    return node.op == "call_function" and (
        node.target in _EMBEDDING_TARGETS
        or getattr(node.target, "overloadpacket", None) is torch.ops.aten.embedding)


def _embedding_args(node: fx.Node) -> tuple:
    """``(indices, weight)`` of an embedding call (F.embedding(input, weight) or
    aten.embedding(weight, indices))."""
    if node.target is torch.nn.functional.embedding:
        return _arg(node, 0, "input"), _arg(node, 1, "weight")
    return _arg(node, 1, "indices"), _arg(node, 0, "weight")


def find_token_embedding(graph: fx.Graph, first_write: fx.Node, vocab_size: int | None) -> tuple:
    """The token embedding that feeds the first decoder layer.

    Candidates are the embedding calls from which ``first_write``'s new keys (layer 0's
    ``kv_write``, argument 3) are computed; a candidate must index a ``[vocab_size, hidden]``
    table (when ``vocab_size`` is known: this tells token from learned position embeddings,
    GPT-2's ``wte`` from ``wpe``) with an integer ``[batch, q_len]`` tensor.

    Returns:
        ``(input_ids node, weight node, None)`` for exactly one candidate, else
        ``(None, None, reason)``.
    """
    frontier, seen, found = [first_write.args[3]], set(), []
    while frontier:
        n = frontier.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if _is_embedding(n):
            found.append(n)
        frontier.extend(n.all_input_nodes)
    matches = []
    for n in found:
        ids, weight = _embedding_args(n)
        ids_val, w_val = example_value(ids), example_value(weight)
        if ids_val is None or w_val is None or ids_val.dim() != 2 or ids_val.dtype.is_floating_point:
            continue
        if w_val.dim() != 2 or (vocab_size is not None and w_val.shape[0] != vocab_size):
            continue
        matches.append((ids, weight))
    if len(matches) != 1:
        return None, None, (
            f"found {len(matches)} token embeddings ({len(found)} embedding calls) feeding layer 0 "
            f"with a vocabulary of {vocab_size}; the draft head needs exactly one (its input_ids)")
    return (*matches[0], None)


def decoder_layer_outputs(graph: fx.Graph, layers: tuple[int, ...]) -> tuple[list | None, str | None]:
    """The output (residual stream after the layer, ``[batch, q_len, hidden]``) of each
    decoder layer in ``layers``.

    A decoder layer is told by the module stack (``nn_module_stack``) of its KV write: the
    outermost module that holds this write and no other (so models with one layer are not
    handled). Its output is the one 3-D node inside that module used by a node outside it
    (the graph's output node aside: stores allocated in prefill graphs are returned there;
    placeholders and state shared by every layer, such as the cache's per-row page shift,
    are no outputs).

    Returns:
        ``(nodes, None)`` in ``layers`` order, or ``(None, reason)``.
    """
    writes = [n for n in graph.nodes if is_op(n, KV_WRITE)]
    stacks = [list((n.meta.get("nn_module_stack") or {}).keys()) for n in writes]
    if len(writes) < 2 or not all(stacks):
        return None, f"cannot tell decoder layers apart ({len(writes)} KV writes with module stacks)"
    modules = []
    for i, stack in enumerate(stacks):
        others = {k for j, other in enumerate(stacks) if j != i for k in other}
        key = next((k for k in stack if k not in others), None)
        if key is None:
            return None, f"the KV write of layer {i} shares every module with another layer"
        modules.append(key)
    outputs = []
    for j in layers:
        if not 0 <= j < len(modules):
            return None, f"auxiliary layer {j} is not one of the model's {len(modules)} decoder layers"
        key = modules[j]

        def inside(n, key=key):
            return key in (n.meta.get("nn_module_stack") or {})

        found = [n for n in graph.nodes
                 if n.op != "placeholder" and inside(n) and getattr(example_value(n), "dim", lambda: 0)() == 3
                 and any(u.op != "output" and not inside(u) for u in n.users)]
        val = example_value(found[0]) if len(found) == 1 else None
        if val is None or val.dim() != 3:
            return None, (f"found no single [batch, q_len, hidden] output of decoder layer {j} "
                          f"({len(found)} candidates)")
        outputs.append(found[0])
    return outputs, None
