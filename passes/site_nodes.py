"""Nodes the rewrite derives from one attention site, shared by the pass and the selection
heads: the query that scores the site's store, ALiBi's bias in the attention layout, and the
store's static capacity."""

from __future__ import annotations

import torch
from torch import fx

from ..runtime import mla
from .sites import AttentionSite, example_value, static_int

__all__ = ["bias_4d", "boolean_source", "selection_query", "static_capacity"]

# an additive mask value at or below this hides its position: float16's minimum (Hugging Face's
# eager masks use the dtype's minimum), whose exp after any realistic logit underflows to 0
HIDDEN_BELOW = float(torch.finfo(torch.float16).min)

MLA_QUERY = mla.latent_query


def bias_4d(graph: fx.Graph, site: AttentionSite) -> fx.Node | None:
    """The site's ALiBi bias ``[b * h, 1, capacity]`` viewed ``[b, h, 1, capacity]`` (one
    node per bias, inserted right after it), or None."""
    bias = site.position_bias
    if bias is None:
        return None
    for user in bias.users:
        if user.meta.get("specontext_bias_4d"):
            return user
    heads = site.num_heads
    with graph.inserting_after(bias):
        view = graph.call_method("unflatten", (bias, 0, (-1, heads)))  # no traced size as a constant
    view.meta["specontext_bias_4d"] = True
    return view


def selection_query(graph: fx.Graph, site: AttentionSite) -> fx.Node:
    """The query that scores the site's store: its own, or for an MLA site the absorbed
    query (:func:`~..runtime.mla.latent_query`, inserted once before the site)."""
    if site.mla is None:
        return site.query
    if site.mla.latent_query is None:
        with graph.inserting_before(site.node):
            site.mla.latent_query = graph.call_function(MLA_QUERY, (site.query, site.mla.weight, site.mla.nope_dim))
    return site.mla.latent_query


def static_capacity(site: AttentionSite) -> int | None:
    """The site's store capacity (tokens) when it is a static int, else None (symbolic or
    unknown): the pass's per-site decisions (dense shortcut, refinement) need static shapes."""
    key = site.key_cache.meta.get("example_value", site.key_cache.meta.get("val"))
    return static_int(key.shape[-2]) if key is not None else None


def boolean_source(mask) -> fx.Node | None:
    """The bool mask an additive float mask was made from, when the graph shows it:
    ``torch.where(visible, 0, m)`` with ``visible`` a bool node, ``0`` a zero scalar or
    ``torch.zeros(())`` and ``m <= -65504`` (Hugging Face's eager masks: ``m`` is the dtype's
    minimum, float16's included), so every logit gets ``+0`` or a weight that underflows to exactly 0: the same
    attention as the bool mask on a row that sees any position (a decode row sees itself).
    None for anything else (a mask with other values: a bias, a learned mask)."""
    if not (isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target is torch.where
            and len(mask.args) == 3 and not mask.kwargs):
        return None
    visible, zero, hidden = mask.args
    cond = example_value(visible)
    if not (isinstance(cond, torch.Tensor) and cond.dtype == torch.bool):
        return None
    return visible if _is_zero(zero) and isinstance(hidden, float) and hidden <= HIDDEN_BELOW else None


def _is_zero(value) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return (isinstance(value, fx.Node) and value.op == "call_function" and value.target is torch.zeros
            and value.args in (((),), ()) and not value.kwargs.get("requires_grad", False))
