"""The retrieval state's size and the paper's GQA scoring rule, shared by the selection heads.

SpeContext (arXiv 2512.00722, section 4) scores past tokens once per decode step, before the
first layer, with a retrieval head: per KV head, the element-wise max over the query heads of
one group of their softmax weights. The heads themselves are the pass's
(``passes/heads.py``: the lagged query, ``passes/head_lagged.py``; a draft head,
``passes/head_draft.py``); their step functions are in :mod:`.aten_step`. Why the lagged
query and not embeddings: docs/design.md (recall table).
"""

from __future__ import annotations

import torch

from .sparse_attention import masked_group_max_softmax

__all__ = ["MAX_RETRIEVAL_LAYERS", "group_max_softmax"]

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
