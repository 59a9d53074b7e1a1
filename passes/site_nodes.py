"""Nodes the rewrite derives from one attention site, shared by the pass and the selection
heads: the query that scores the site's store, ALiBi's bias in the attention layout, and the
store's static capacity."""

from __future__ import annotations

from torch import fx

from ..runtime import mla
from .sites import AttentionSite, static_int

__all__ = ["bias_4d", "selection_query", "static_capacity"]

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
