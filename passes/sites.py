"""Find attention sites and their KV-cache writes in a dynamo FX graph (torch-level ops).

A *site* is one attention call. It is *matched* when its key and value provably read the
whole store of one ``specontext::kv_write`` (directly, or through Hugging Face's exact
``repeat_kv`` expansion), its constants are the ones sparse attention reproduces (no dropout,
no causal flag for decode, a known scale), and its query has a static length. Anything else
keeps exact dense attention and gets a reason string. Constants are checked, never
wildcarded: a different expansion or softmax dimension must not match.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

__all__ = ["AttentionSite", "find_attention_sites", "SDPA_TARGETS", "is_op"]

SDPA_TARGETS = (torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
KV_WRITE = torch.ops.specontext.kv_write
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FULL = slice(None, None, None)


@dataclasses.dataclass
class AttentionSite:
    """One attention call in the graph.

    ``layer`` is the position of its KV write among all writes (graph order, i.e. decoder
    layer order), set whenever the store was resolved (even if the site stays dense);
    ``reason`` is None when the site can be rewritten.
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
    reason: str | None = None

    @property
    def key_cache(self) -> fx.Node:
        return self.write.args[0]

    @property
    def value_cache(self) -> fx.Node:
        return self.write.args[1]

    @property
    def length(self) -> fx.Node:
        return self.write.args[2]


def is_op(node: fx.Node, packet: torch._ops.OpOverloadPacket) -> bool:
    """True when ``node`` calls ``packet`` (dynamo records packets, AOT records overloads)."""
    return node.op == "call_function" and (
        node.target is packet or getattr(node.target, "overloadpacket", None) is packet
    )


def _val(node) -> torch.Tensor | None:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _static_int(x) -> int | None:
    return x if isinstance(x, int) else None


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
    src, out, exp = index.args[0], _val(node), _val(expand)
    src_val = _val(src)
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


def _writes_by_store(graph: fx.Graph) -> tuple[dict, dict]:
    writes = [n for n in graph.nodes if is_op(n, KV_WRITE)]
    by_key = {w.args[0]: (i, w) for i, w in enumerate(writes)}
    by_value = {w.args[1]: (i, w) for i, w in enumerate(writes)}
    return by_key, by_value


def _resolve_store(site: AttentionSite, args: dict, by_key: dict, by_value: dict, order: dict) -> str | None:
    """Find the KV write whose stores the site reads; returns a reason when there is none."""
    key_src, kg = _strip_repeat_kv(_strip_prefix_slice(args["key"]))
    value_src, vg = _strip_repeat_kv(_strip_prefix_slice(args["value"]))
    if key_src not in by_key or value_src not in by_value:
        return "key/value do not come from a SpeContextCache store (use cache=SpeContextCache(...))"
    layer, write = by_key[key_src]
    if by_value[value_src][1] is not write:
        return "key and value come from different KV writes"
    if order[write] > order[site.node]:
        return "KV write happens after the attention"
    site.num_kv_heads = _static_int(_val(key_src).shape[1])
    q = _val(site.query)
    site.num_heads = _static_int(q.shape[1]) if q is not None and q.dim() == 4 else None
    groups = kg
    if args.get("enable_gqa", False) and site.num_heads and site.num_kv_heads:
        groups = site.num_heads // site.num_kv_heads
    if kg != vg or site.num_kv_heads is None or site.num_kv_heads * groups != site.num_heads:
        return f"head mapping is not GQA: {site.num_heads} query heads, {site.num_kv_heads} KV heads x {kg}"
    site.write, site.layer = write, layer
    return None


def _check_constants(site: AttentionSite, args: dict) -> str | None:
    """Reasons the site cannot become sparse attention (the store is already resolved)."""
    q = _val(site.query)
    if args.get("dropout_p", 0.0) != 0.0:
        return f"dropout_p={args['dropout_p']} (sparse attention has no dropout)"
    site.q_len, site.head_dim = _static_int(q.shape[2]), _static_int(q.shape[3])
    if site.q_len is None or site.head_dim is None:
        return "query length or head_dim is dynamic (prefill graphs stay dense)"
    if args.get("is_causal", False) and site.q_len != 1:
        return "is_causal=True with a multi-token query (prefill-style call)"
    if _strip_prefix_slice(args["key"]) is not args["key"]:
        return "key is a cropped prefix of the store (prefill-style call)"
    scale = args.get("scale")
    if scale is not None and not isinstance(scale, float):
        return "scale is not a constant"
    site.scale = scale if scale is not None else site.head_dim**-0.5
    mask = site.attn_mask
    if mask is not None and (_val(mask) is None or _val(mask).dim() != 4):
        return "attention mask is not 4-D"
    return None


def _match_sdpa(site: AttentionSite, by_key: dict, by_value: dict, order: dict) -> None:
    args = _sdpa_args(site.node)
    site.query, site.attn_mask = args.get("query"), args.get("attn_mask")
    q = _val(site.query)
    if q is None or q.dim() != 4:
        site.reason = "query has no 4-D example value"
        return
    site.reason = _resolve_store(site, args, by_key, by_value, order) or _check_constants(site, args)


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
    """Walk back from the attention weights through an identity dropout and a dtype cast
    to a softmax; returns it and the nodes passed."""
    chain, node = [], weights
    if _is_call(node, (torch.nn.functional.dropout,)):
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
        if p != 0.0 and training is not False:
            return None, chain
        chain.append(node)
        node = node.args[0]
    if _is_call(node, method="to"):
        chain.append(node)
        node = node.args[0]
    if _is_call(node, _SOFTMAX, method="softmax"):
        return node, chain
    return None, chain


def _transposed_key(node) -> fx.Node | None:
    """``k`` when ``node`` is ``k.transpose(2, 3)`` of a 4-D ``k`` (any sign convention)."""
    if not (_is_call(node, (torch.transpose,), method="transpose") and len(node.args) == 3):
        return None
    dims = {d % 4 for d in node.args[1:] if isinstance(d, int)}
    return node.args[0] if dims == {2, 3} else None


def _match_eager(site: AttentionSite, by_key: dict, by_value: dict, order: dict) -> None:
    """``softmax(q @ k^T * scale + mask, dim=-1) @ v`` written out (HF "eager")."""
    site.pattern = "eager"
    weights, value = site.node.args[0], site.node.args[1]
    softmax, chain = _softmax_of(weights)
    dim = _arg(softmax, 1, "dim")
    if not isinstance(dim, int) or dim not in (-1, 3):
        site.reason = f"softmax over dim {dim}, not the key dimension"
        return
    node, mask, scale = softmax.args[0], None, 1.0
    if _is_call(node, (operator.add, torch.add)):
        node, mask = node.args
        if not isinstance(mask, fx.Node) or _val(mask) is None or _val(mask).dim() != 4:
            site.reason = "the added mask is not a 4-D tensor"
            return
        chain.append(softmax.args[0])
    if _is_call(node, (operator.mul,)) and isinstance(node.args[1], float):
        chain.append(node)
        node, scale = node.args
    if not _is_call(node, _MATMUL):
        site.reason = "attention scores are not a plain q @ k^T product"
        return
    chain += [node, softmax]
    if any(len(n.users) != 1 for n in chain):
        site.reason = "intermediate attention scores or weights are used elsewhere"
        return
    key = _transposed_key(node.args[1])
    if key is None:
        site.reason = "key reaches the score product through another permutation"
        return
    site.query, site.attn_mask = node.args[0], mask
    args = {"key": key, "value": value}
    site.reason = _resolve_store(site, args, by_key, by_value, order)
    if site.reason is None:
        site.reason = _check_constants(site, args)
        site.scale = scale


def find_attention_sites(graph: fx.Graph) -> list[AttentionSite]:
    """Every SDPA call and written-out softmax attention in ``graph``, matched against the
    KV writes (see module docstring)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key, by_value = _writes_by_store(graph)
    sites = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            site = AttentionSite(node=node)
            _match_sdpa(site, by_key, by_value, order)
            sites.append(site)
        elif _is_call(node, _MATMUL) and _softmax_of(node.args[0])[0] is not None:
            site = AttentionSite(node=node)
            _match_eager(site, by_key, by_value, order)
            sites.append(site)
    return sites
