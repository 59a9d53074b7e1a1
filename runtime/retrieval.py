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

__all__ = ["MAX_RETRIEVAL_LAYERS", "default_retrieval_layers", "group_max_softmax", "picked_retrieval_layers"]

MAX_RETRIEVAL_LAYERS = 8  # slots of retrieval state a SpeContextCache holds


def default_retrieval_layers(num_layers: int) -> tuple[int, ...]:
    """Eight layers over the whole depth, denser early: (2, 4, 8, 12, 16, 20, 24, 28) for 30.

    The late layers' picks (16..28) join the first five (issue 12): on SmolLM2-135M they
    lift the attention recall of the late layers (figures and command: docs/fidelity.md,
    ``python -m benchmarks.guard_estimate``). Cost: the selection node reads 8 layers'
    keys once per step instead of 5."""
    fractions = (1 / 15, 2 / 15, 4 / 15, 6 / 15, 8 / 15, 10 / 15, 12 / 15, 14 / 15)
    picks = {min(num_layers - 1, round(num_layers * f)) for f in fractions}
    return tuple(sorted(picks))


def picked_retrieval_layers(layers: tuple[int, ...] | int | None, num_layers: int) -> list[int]:
    """The option ``retrieval_layers`` over ``num_layers`` KV layers, sorted and distinct:
    None = :func:`default_retrieval_layers`, an int = that one layer, negative counts from the
    end, clamped into the layers (what the lagged-query head and the cache's int8 keys read)."""
    if isinstance(layers, int):
        layers = (layers,)
    layers = layers or default_retrieval_layers(num_layers)
    return sorted({min(max(j + num_layers if j < 0 else j, 0), num_layers - 1) for j in layers})


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
