"""Attention recall of a decode step, measured from outside it (the fidelity harness's probe).

Attention recall (docs/design.md, "Fidelity"; SpeContext, arXiv 2512.00722, section 7) is the
share of a layer's dense attention mass, over every written token, that falls inside the
tokens its selection kept. The step's own functions do not measure it: a :class:`RecallProbe`
runs the lowered step's graph with an :class:`torch.fx.Interpreter` (the option ``inner``
given as the probe's :meth:`~RecallProbe.runner`, which the backend calls with the same
lowered, unfused graph ``inner="eager"`` runs) and, at each attention node, reads that node's
arguments by name — query, key store, kept indices, length, mask, variant — before running
it. The graph, the functions and their numbers are those of ``inner="eager"``; only the
measurement is added, and only inside a :meth:`~RecallProbe.recording` block (other steps
run the graph module's own Python).

It costs a float64 dense attention per layer, so callers record a few sampled decode steps
(``specontext run``: ``report.py``; tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from .runtime import (
    aten_step,
    mla,
    offload_step,
    ops_attention,  # noqa: F401  (register the attention op)
)
from .runtime.sparse_attention import causal_limit_mask
from .runtime.spec import AttentionVariant
from .runtime.torch_private import OpOverload

__all__ = ["RecallProbe", "RecallRecord", "selection_recall"]


@dataclasses.dataclass
class RecallRecord:
    """Recall per attention node, in the step's order (one per rewritten layer).

    ``values[i]``: the mean over batch, query heads and query rows of the dense attention
    probability mass inside the selection (a float in [0, 1]); 1.0 where the fidelity guard
    ran the layer densely.
    """

    values: list[float] = dataclasses.field(default_factory=list)

    def mean(self) -> float:
        """Mean recall over the recorded nodes; ``nan`` when none were recorded."""
        return sum(self.values) / len(self.values) if self.values else float("nan")


def selection_recall(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    indices: torch.Tensor,
    length: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    soft_cap: float | None = None,
    sliding_window: int = 0,
) -> float:
    """Share of dense attention mass (float64) inside the selection for one layer.

    The dense attention is the one the layer computes (as
    :func:`~specontext_compile.runtime.sparse_attention.attend_gathered` does over the
    selection): logits ``q . k * scale``, then ``soft_cap * tanh(logits / soft_cap)`` when
    ``soft_cap`` is set, then the mask; row ``r`` sees positions ``p <= length - q_len + r``
    and, with ``sliding_window > 0``, only ``p > length - q_len + r - sliding_window``.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]`` (positions ``< length`` read).
        indices: kept positions ``[batch, num_kv_heads, k]`` (int64, ``-1`` padding).
        length: written tokens, this step's included.
        scale: the logits' scale; ``attn_mask``: the site's additive or bool mask
            ``[batch, 1 or num_heads, q_len, >= length]``, or None.
    """
    b, num_heads, q_len, d = query.shape
    num_kv = key_cache.shape[1]
    groups = num_heads // num_kv
    keys = key_cache[:, :, :length].double()
    q = query.double().reshape(b, num_kv, groups * q_len, d)
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [b, kv, g*q, length]; float64
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    logits = logits.view(b, num_kv, groups, q_len, length)
    every = torch.arange(length, device=key_cache.device).view(1, 1, length)
    allowed = causal_limit_mask(every, torch.tensor(length), q_len, sliding_window).unsqueeze(2)
    if attn_mask is not None:
        m = attn_mask[..., :length]
        m = m.view(m.shape[0], -1, 1, q_len, length) if m.shape[1] == 1 else m.reshape(
            m.shape[0], num_kv, groups, q_len, length
        )
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            logits = logits + m.double()
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    # last column: padding slots (-1) and slots past the written tokens (a dense route's
    # selection names every slot of the store: ``aten_step.every_slot``)
    chosen = torch.zeros(b, num_kv, length + 1, dtype=torch.bool, device=key_cache.device)
    chosen.scatter_(2, torch.where((indices >= 0) & (indices < length), indices, length), True)
    mass = (probs * chosen[..., :length].view(b, num_kv, 1, 1, length)).sum(-1)
    return float(mass.nan_to_num(0.0).mean())


@dataclasses.dataclass(frozen=True)
class _Site:
    """What one attention node's arguments mean for recall: the query, the full key store
    (float, ``[batch, num_kv_heads, capacity, width]``) and the fidelity guard's decision,
    each read from the node's arguments by name."""

    query: Callable[[dict], torch.Tensor]
    keys: Callable[[dict], torch.Tensor]
    dense: Callable[[dict], Any] = lambda a: None
    latent: bool = False  # MLA: the latent product has no soft cap and no window


def _latent_keys(a: dict) -> torch.Tensor:
    if "stores" in a:
        latent, rope = a["stores"]
    else:  # mla.mla_sparse_attention names them; the op calls them key_cache, value_cache
        latent, rope = (a["latent_cache"], a["rope_cache"]) if "latent_cache" in a else (a["key_cache"], a["value_cache"])
    return torch.cat([latent, rope], dim=-1)


_PLAIN = _Site(query=lambda a: a["query"], keys=lambda a: a["key_cache"])
_STORE = _Site(query=lambda a: a["query"], keys=lambda a: a["store"][0], dense=lambda a: a.get("dense"))
_LATENT = _Site(query=lambda a: a["latent_q"] if "latent_q" in a else a["query"], keys=_latent_keys, dense=lambda a: a.get("dense"), latent=True)

#: every attention a lowered step may call, eager (``fuse=False``) or with ``lower=False``
_SITES: dict[Any, _Site] = {
    aten_step.sparse_attention: _PLAIN,
    torch.ops.specontext.sparse_attention.default: _PLAIN,  # _LATENT where its variant is MLA's
    aten_step.guarded_attention: _STORE,
    aten_step.sinks_attention: _STORE,
    offload_step.attention: _Site(query=lambda a: a["query"], keys=lambda a: a["rows"][2]),
    mla.mla_sparse_attention: _LATENT,
    mla.attend_latent: _LATENT,
}
_OP = torch.ops.specontext.sparse_attention.default


def _arguments(target, args: tuple, kwargs: dict) -> dict:
    """A node's arguments by parameter name (an op's from its schema)."""
    if isinstance(target, OpOverload):
        names = [a.name for a in target._schema.arguments]
        return {**dict(zip(names, args)), **kwargs}
    bound = inspect.signature(target).bind(*args, **kwargs)
    return dict(bound.arguments)


def site_recall(target, args: tuple, kwargs: dict) -> float | None:
    """Recall of one attention node about to run with these arguments; None for a node that
    is not an attention (:data:`_SITES`)."""
    site = _SITES.get(target)
    if site is None:
        return None
    a = _arguments(target, args, kwargs)
    if target is _OP and a["variant"].nope_dim:
        site = _LATENT
    dense = site.dense(a)
    if dense is not None and bool(dense):
        return 1.0
    variant: AttentionVariant = a["variant"]
    soft_cap, window = (None, 0) if site.latent else (variant.soft_cap, variant.sliding_window)
    return selection_recall(site.query(a), site.keys(a), a["indices"], int(a["length"]), variant.scale,
                            a.get("attn_mask"), soft_cap, window)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph node by node, recording each attention node's recall before it runs."""

    def __init__(self, gm: torch.fx.GraphModule, record: RecallRecord):
        super().__init__(gm, garbage_collect_values=True)
        self.record = record

    def call_function(self, target, args, kwargs):
        value = site_recall(target, args, kwargs)
        if value is not None:
            self.record.values.append(value)
        return super().call_function(target, args, kwargs)


class RecallProbe:
    """Measures attention recall on the steps run inside :meth:`recording`.

    Use::

        probe = RecallProbe()
        step = torch.compile(model.forward, backend="specontext",
                             options={**options, "inner": probe.runner})
        step(...)                          # prefill, other decode steps: not measured
        with probe.recording() as record:
            step(...)                      # this step's attention nodes are measured
        record.values                      # one recall per rewritten layer

    The graphs are those of ``inner="eager"`` (the lowered step, not fused, run without
    inductor): the same functions and numbers as the step users run, up to inductor's fusion.
    """

    def __init__(self) -> None:
        self._record: RecallRecord | None = None

    def runner(self, gm: torch.fx.GraphModule) -> Callable:
        """The option ``inner``'s runner: called by the backend once per compiled graph with the
        lowered graph module; returns the function dynamo calls for each step."""

        def run(*args):
            if self._record is None:
                return gm.forward(*args)
            return _Recorder(gm, self._record).run(*args)

        return run

    @contextlib.contextmanager
    def recording(self) -> Iterator[RecallRecord]:
        """Record the recall of every attention node run inside the block."""
        record, previous = RecallRecord(), self._record
        self._record = record
        try:
            yield record
        finally:
            self._record = previous
