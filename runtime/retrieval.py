"""Retrieval heads: what scores past tokens once per decode step, before the first layer.

The interface any head implements is :class:`RetrievalHead`: given the step's retrieval
query state and a key cache, return per-KV-head scores over the cached positions
(``[batch, num_kv_heads, n]``, higher = attend). SpeContext (arXiv 2512.00722, section 4)
builds the head from a distilled model (EAGLE-3 draft: embedding + Q/K projections with
RoPE and its own K cache); those heads are a later addition behind the same interface.

The training-free head shipped now, :class:`LaggedQueryHead`, is built from the target
model itself and needs no weights of its own: for each retrieval layer ``j`` its query is
the query that layer ``j`` computed for the previous token (recorded in the graph at layer
``j`` during the previous step), and its keys are layer ``j``'s own key cache (already in
the KV store, so no extra key cache). Per layer, scores are ``softmax(q_prev . K_j * scale)``
per query head, then the element-wise max over the query heads of each KV group (the
paper's GQA rule); the selection node sums them over the retrieval layers.
Why not embeddings: on SmolLM2-135M and 6K tokens of pydoc text at budget 1024, heads made of
one target layer's Q/K projections applied to token embeddings covered 0.68-0.83 of the
attention mass, below a plain sink+recent selection (0.86); one lagged layer-8 query covered
0.915 and the sum over layers 2, 4, 8, 12, 20 0.936 (docs/design.md has the table).
"""

from __future__ import annotations

import abc

import torch

from .aten_step import masked_group_max_softmax

__all__ = ["MAX_RETRIEVAL_LAYERS", "LaggedQueryHead", "RetrievalHead", "group_max_softmax"]

MAX_RETRIEVAL_LAYERS = 8  # slots of retrieval state a SpeContextCache holds


def group_max_softmax(
    query: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-KV-group attention weights of a single query row.

    Args:
        query: ``[batch, num_heads, 1, head_dim]``.
        keys: ``[batch, num_kv_heads, n, head_dim]``.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).

    Returns:
        float32 ``[batch, num_kv_heads, n]``: max over the query heads of each group of
        their softmax weights (paper section 4, GQA mapping).
    """
    every = torch.ones(keys.shape[-2], dtype=torch.bool, device=keys.device)
    return masked_group_max_softmax(query, keys, every, scale)  # the selection node's own code


class RetrievalHead(abc.ABC):
    """Scores cached tokens for the coming step. Subclasses are small and stateless."""

    name: str = "abstract"

    @abc.abstractmethod
    def scores(
        self, query_state: torch.Tensor, key_cache: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        """Return ``[batch, num_kv_heads, n]`` float scores for positions ``0 .. n-1``."""


class LaggedQueryHead(RetrievalHead):
    """Training-free head: previous token's layer-``j`` query against layer ``j``'s keys."""

    name = "lagged-query"

    def scores(
        self, query_state: torch.Tensor, key_cache: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        return group_max_softmax(query_state, key_cache[:, :, :n], scale)
