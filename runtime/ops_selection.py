"""Selection ops (``specontext::``) of the training-free lagged-query head: recording each
retrieval layer's query, and the selection node. Bodies: :mod:`.aten_step`."""

from __future__ import annotations

from typing import Optional

import torch
from torch._dynamo.utils import counters

from . import aten_step
from .spec import AttentionVariant, StepSpec

__all__ = ["refine_selection", "speculative_select"]


@torch.library.custom_op("specontext::speculative_select", mutates_args=())
def speculative_select(
    query_state: torch.Tensor,
    query_valid: torch.Tensor,
    key_caches: list[torch.Tensor],
    length: torch.Tensor,
    q_len: int,
    spec: StepSpec,
    variant: AttentionVariant,
    attn_mask: Optional[torch.Tensor] = None,
    mla: bool = False,
    position_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The speculative-selection node (SpeContext section 4), once per decode step (once per
    distinct sliding window when layers differ, e.g. Gemma's alternating layers).

    Args:
        query_state: ``[slots, batch, num_heads, 1, head_dim]``: slot ``i`` holds the query
            that retrieval layer ``i`` computed for the previous token.
        query_valid: int64 ``[slots]``, the length slot ``i`` was recorded at (0 = never);
            unless every used slot was recorded at ``length`` (by the step that wrote the
            last cached token), the most recent tokens are selected instead.
        key_caches: the retrieval layers' key stores, each
            ``[batch, num_kv_heads, capacity, head_dim]``, in slot order.
        length: written tokens *before* this step (int64 scalar, the same for all layers).
        q_len: tokens in this step.
        spec: :class:`~.spec.StepSpec` (``candidate_slots``, ``sink_tokens``,
            ``recent_window``).
        variant: the retrieval layers' :class:`~.spec.AttentionVariant` (scale; a sliding
            window ``w > 0`` selects only inside the window of the step's rows, see
            :func:`~specontext_compile.runtime.selection.select_tokens`).
        attn_mask: the first site's Hugging Face mask (or None): positions a batch row may
            not attend to (left padding) are never selected and do not count as sinks.

    Returns:
        int64 ``[batch, num_kv_heads, min(spec.candidate_slots, capacity)]`` positions valid
        after this step's write (``-1`` = padding), shared by every layer of the step.
    """
    counters["specontext"]["selection_calls"] += 1
    return aten_step.speculative_select(query_state, query_valid, key_caches, length, q_len, spec, variant,
                                        attn_mask, mla, position_bias)


@speculative_select.register_fake
def _(query_state, query_valid, key_caches, length, q_len, spec, variant, attn_mask=None, mla=False,
      position_bias=None):
    key_cache = key_caches[0]
    slots = torch.sym_max(q_len, torch.sym_min(spec.candidate_slots, key_cache.shape[-2]))
    return key_cache.new_empty((key_cache.shape[0], key_cache.shape[1], slots), dtype=torch.long)


@torch.library.custom_op("specontext::refine_selection", mutates_args=("stats",))
def refine_selection(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    candidates: torch.Tensor,
    length: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    pages: list[Optional[torch.Tensor]],
    spec: StepSpec,
    variant: AttentionVariant,
    stats: Optional[torch.Tensor] = None,
    rope_cache: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer second stage of the two-stage selection (``spec.refines``): the layer's own
    query keeps the ``spec.budget`` of the step's ``candidates`` it attends to most, and the
    fidelity guard (``spec.min_coverage > 0``) decides whether the layer must run dense.
    Shapes, semantics and the coverage estimate:
    :func:`~specontext_compile.runtime.aten_step.refine_selection`.
    ``rope_cache``: MLA layers only (the rotary key store; ``key_cache`` is the latent one).
    ``pages``: ``[]`` or ``[page_min, page_max, page_shift]``, the page rescue's operands
    (:mod:`~specontext_compile.runtime.page_bounds`).
    Returns ``(indices [batch, num_kv_heads, budget] int64, dense: bool scalar)``."""
    counters["specontext"]["refine_calls"] += 1
    return aten_step.refine_selection(query, key_cache, candidates, length, attn_mask, pages, spec, variant,
                                      stats, rope_cache)


@refine_selection.register_fake
def _(query, key_cache, candidates, length, attn_mask, pages, spec, variant, stats=None, rope_cache=None):
    b, kv = candidates.shape[0], candidates.shape[1]
    return candidates.new_empty((b, kv, spec.budget)), candidates.new_empty((), dtype=torch.bool)
