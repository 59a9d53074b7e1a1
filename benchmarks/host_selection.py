"""A host-side wrapper of the selection for the fidelity harness and the tests (Python int
lengths; it calls ``aten_step.select_positions``, the step's own code): scores in, positions
out.

SpeContext (arXiv 2512.00722, section 4) selects the top-K tokens per KV head from the
retrieval head's attention weights (for GQA: the element-wise max over the query heads of
one group). We add two kinds of always-kept tokens, counted inside the budget: the first
``sink_tokens`` positions (attention sinks) and the last ``recent_window`` positions (which
always include the tokens of the current step, so a selection is never empty). The paper
does not use them; they are a design choice of ours (docs/design.md).

Sliding-window layers (Mistral, Gemma 2/3, ...) see only the last ``sliding_window``
positions of each query row; their selection is made among those positions only (and keeps
no sinks), so no budget slot is spent on a token the layer cannot see.
"""

from __future__ import annotations

import torch

__all__ = ["select_tokens", "selection_size", "window_start"]


def selection_size(budget: int, capacity: int) -> int:
    """Slots in a selection: ``min(budget, capacity)`` tokens per KV head."""
    return max(1, min(budget, capacity))


def window_start(length: int, q_len: int, sliding_window: int) -> int:
    """First position any query row of the step may see with a sliding window of
    ``sliding_window`` tokens (HF: key ``p`` visible from query ``q`` iff ``q - w < p <= q``);
    0 when ``sliding_window`` is 0 (full attention)."""
    if sliding_window <= 0:
        return 0
    return max(0, length - q_len - sliding_window + 1)


def select_tokens(
    scores: torch.Tensor,
    length: int,
    q_len: int,
    slots: int,
    sink: int,
    window: int,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Pick ``slots`` positions per KV head (host-known lengths).

    Args:
        scores: ``[batch, num_kv_heads, n]`` float, higher = keep, for positions
            ``0 .. n-1`` with ``n >= length - q_len`` (at least the tokens cached before
            this step; only those are ranked).
        length: tokens in the cache after this step's write.
        q_len: new tokens in this step (always inside the recent window).
        slots: selection size (see :func:`selection_size`).
        sink, window: always-kept first / last positions (counted in ``slots``).
        sliding_window: 0 for full attention; else only positions from
            :func:`window_start` on are candidates, and no sinks are kept (the first
            tokens of a moving window are not attention sinks).

    Returns:
        int64 ``[batch, num_kv_heads, slots]`` ascending: unique positions ``< length`` (and
        inside the sliding window when one is given); when the visible positions fit in
        ``slots``, all of them after ``-1`` padding.

    This is a host-side entry point to the one selection implementation,
    :func:`~specontext_compile.runtime.aten_step.select_positions` (what the compiled step
    runs): the fidelity harness and the policies use it, so the measured selection is the
    shipped one.

    Raises:
        ValueError: when ``slots < q_len`` (the step's own tokens would not fit; the
            rewrite pass keeps such steps dense).
    """
    if slots < q_len:
        raise ValueError(f"a selection of {slots} tokens cannot hold the step's {q_len} tokens")
    from specontext_compile.runtime.aten_step import select_positions

    b, h, n = scores.shape
    cached = length - q_len
    capacity = max(length, slots)
    ranked = scores[..., :cached].float()
    if capacity > cached:  # this step's positions and spare slots: never ranked by score
        ranked = torch.cat([ranked, ranked.new_zeros(b, h, capacity - cached)], -1)
    return select_positions(ranked, torch.tensor(cached, device=scores.device), q_len, slots, sink, window,
                            sliding_window)
