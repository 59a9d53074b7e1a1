"""Token-selection policies compared in the fidelity harness (``benchmarks/fidelity.py``).

Each policy is one small dataclass with ``scores(step, layer) -> [num_kv_heads, n]``
(higher = keep) over the ``n`` tokens cached before the step; the harness turns scores into
selections with :func:`~benchmarks.host_selection.select_tokens`, the same sinks
and recent window inside the same budget for every policy, so all attend to the same number
of tokens. ``shared`` policies score once per step for every layer (SpeContext's setting);
the others select per layer from that layer's own state (the "layer-wise retrieval" of the
peers, which sits on every layer's critical path).

Policies (batch 1, the shapes of one decode step as recorded by the harness):

* :class:`LaggedQuery` — ours: previous-step queries of some layers vs their key caches
  (the product's scorer, :mod:`specontext_compile.runtime.scorers`).
* :class:`DraftHead` — SpeContext's own head: a pruned EAGLE-3 / distilled draft with its
  own key cache over the token ids (and fused hidden states); the product's scorer.
* :class:`StreamingLLM` — attention sinks + recent window only (Xiao et al., 2023).
* :class:`Quest` — per-layer page scores from per-channel key min/max bounds of 16-token
  pages and the current query (Tang et al., ICML 2024).
* :class:`H2O` — per-layer accumulated attention ("heavy hitters", Zhang et al., 2023), over
  the last recorded prompt queries and the decode steps so far.
* :class:`OracleTopK` — the layer's own exact attention (upper bound).
* :class:`RandomTokens` — random scores (floor).
"""

from __future__ import annotations

import dataclasses

import torch
from specontext_compile.runtime import scorers
from specontext_compile.runtime.retrieval import group_max_softmax
from specontext_compile.runtime.spec import AttentionVariant

__all__ = ["H2O", "DecodeStep", "LaggedQuery", "OracleTopK", "Quest", "RandomTokens", "StreamingLLM"]


@dataclasses.dataclass
class DecodeStep:
    """What one decode step exposes to policies (batch 1).

    Attributes:
        queries: per layer ``[1, num_heads, 1, head_dim]`` query of this step.
        keys: per layer ``[1, num_kv_heads, n + 1, head_dim]`` keys, this step's included.
        previous_queries: per layer, the previous step's query (None at the first step).
        accumulated: per layer ``[num_kv_heads, n]`` accumulated attention (for H2O).
        scale: softmax scale.
        input_ids, aux_hidden: token ids and auxiliary hidden states of every token (for
            heads with their own key cache, e.g. distilled / EAGLE-3 heads).
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    previous_queries: list[torch.Tensor] | None
    accumulated: list[torch.Tensor] | None
    scale: float
    input_ids: torch.Tensor | None = None  # [1, n + 1]
    aux_hidden: torch.Tensor | None = None  # [1, n + 1, 3 * hidden], previous token's states

    @property
    def cached(self) -> int:
        """Tokens cached before this step."""
        return self.keys[0].shape[2] - 1


@dataclasses.dataclass
class LaggedQuery:
    """Ours (docs/design.md): the product's lagged-query scorer
    (:func:`~specontext_compile.runtime.scorers.lagged_query_score`: summed group-max softmax of
    the previous step's queries of ``layers``), fed the step's record."""

    layers: tuple[int, ...] = (2, 4, 8, 12, 20)
    shared = True

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        if step.previous_queries is None:
            raise ValueError("LaggedQuery needs the previous step's queries (start at step 1)")
        n = step.cached
        cached = torch.tensor(n)
        state = torch.stack([step.previous_queries[j][:, :, -1:] for j in self.layers])  # [slots, 1, H, 1, d]
        record = (state, torch.full((len(self.layers),), n))
        stores = [step.keys[j] for j in self.layers]
        return scorers.lagged_query_score(record, stores, cached, 1, None, AttentionVariant(step.scale))[0, :, :n]


@dataclasses.dataclass
class StreamingLLM:
    """Sinks + recent window only: scores favour recent tokens (the window fills the rest)."""

    shared = True

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        n = step.cached
        return torch.arange(n, dtype=torch.float32).expand(step.keys[0].shape[1], n)


@dataclasses.dataclass
class Quest:
    """Per-layer page upper bounds: ``sum_c max(q_c * min_c, q_c * max_c)`` per page."""

    page_tokens: int = 16
    shared = False

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        n, p = step.cached, self.page_tokens
        keys = step.keys[layer][0, :, :n].float()  # [kv, n, d]
        kv, _, d = keys.shape
        pages = -(-n // p)
        padded = torch.nn.functional.pad(keys, (0, 0, 0, pages * p - n), value=float("nan"))
        padded = padded.view(kv, pages, p, d)
        kmin = padded.nan_to_num(float("inf")).amin(2)
        kmax = padded.nan_to_num(float("-inf")).amax(2)
        q = step.queries[layer][0, :, 0].float()  # [heads, d]
        q = q.view(kv, -1, 1, d)  # [kv, g, 1, d]
        bound = torch.maximum(q * kmin[:, None], q * kmax[:, None]).sum(-1).amax(1)  # [kv, pages]
        return bound.repeat_interleave(p, dim=1)[:, :n]  # every token takes its page's bound


@dataclasses.dataclass
class H2O:
    """Per-layer accumulated attention received by each token (max over the group)."""

    shared = False

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        return step.accumulated[layer][:, : step.cached]


@dataclasses.dataclass
class OracleTopK:
    """The layer's exact attention of this step (an upper bound, not a method)."""

    shared = False

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        return group_max_softmax(step.queries[layer], step.keys[layer][:, :, : step.cached], step.scale)[0]


@dataclasses.dataclass
class RandomTokens:
    """Random scores (the floor)."""

    seed: int = 0
    shared = True

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + step.cached)
        return torch.rand(step.keys[0].shape[1], step.cached, generator=gen)


@dataclasses.dataclass
class DraftHead:
    """A retrieval head with its own keys (SpeContext section 4): softmax of the current
    token's head query over the head's keys of the cached tokens, one head per KV head."""

    head: torch.nn.Module
    fused: bool = True
    shared = True

    def scores(self, step: DecodeStep, layer: int) -> torch.Tensor:
        """The product's draft scorer (:func:`~specontext_compile.runtime.scorers.draft_score`)
        over the ``n`` cached tokens only (``q_len = 0``: the step's own token left out of the
        softmax), for the head's own KV heads."""
        ids, aux = step.input_ids, step.aux_hidden
        if ids is None or aux is None:
            raise ValueError("DraftHead needs the step's input_ids and aux_hidden")
        if not self.fused:
            aux = torch.zeros_like(aux)
        with torch.no_grad():
            q, k = self.head(ids, aux, torch.arange(ids.shape[1])[None])
        n = step.cached
        record = (q[:, :, -1:], k, torch.tensor(k.shape[2]))
        target = k.new_empty(1, k.shape[1], n, 1)  # the scores' shape: the head's KV heads, the cached tokens
        return scorers.draft_score(record, [target], torch.tensor(n), 0, None, AttentionVariant(1.0))[0]
