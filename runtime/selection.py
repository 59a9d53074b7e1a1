"""Turning retrieval-head scores into a per-KV-head token selection of fixed size.

SpeContext (arXiv 2512.00722, section 4) selects the top-K tokens per KV head from the
retrieval head's attention weights (for GQA: the element-wise max over the query heads of
one group). We add two kinds of always-kept tokens, counted inside the budget: the first
``sink_tokens`` positions (attention sinks) and the last ``recent_window`` positions (which
always include the tokens of the current step, so a selection is never empty). The paper
does not use them; they are a design choice of ours (docs/design.md).
"""

from __future__ import annotations

import torch

__all__ = ["select_tokens", "selection_size"]


def selection_size(budget: int, capacity: int) -> int:
    """Slots in a selection: ``min(budget, capacity)`` tokens per KV head."""
    return max(1, min(budget, capacity))


def _forced_positions(length: int, q_len: int, slots: int, sink: int, window: int) -> torch.Tensor:
    """Sink positions then the recent window, within ``[0, length)``, at most ``slots``."""
    window = min(max(window, q_len), slots, length)
    sink = min(sink, slots - window, length - window)
    recent = torch.arange(length - window, length)
    return torch.cat([torch.arange(sink), recent])


def select_tokens(
    scores: torch.Tensor,
    length: int,
    q_len: int,
    slots: int,
    sink: int,
    window: int,
) -> torch.Tensor:
    """Pick ``slots`` positions per KV head.

    Args:
        scores: ``[batch, num_kv_heads, n]`` float, higher = keep, for positions
            ``0 .. n-1`` with ``n >= length - q_len`` (at least the tokens cached before
            this step; only those are ranked).
        length: tokens in the cache after this step's write.
        q_len: new tokens in this step (always inside the recent window).
        slots: selection size (see :func:`selection_size`).
        sink, window: always-kept first / last positions (counted in ``slots``).

    Returns:
        int64 ``[batch, num_kv_heads, slots]``: unique positions ``< length``; when
        ``length <= slots`` every position ``0 .. length-1`` followed by ``-1`` padding.

    Raises:
        ValueError: when ``slots < q_len`` (the step's own tokens would not fit; the
            rewrite pass keeps such steps dense).
    """
    if slots < q_len:
        raise ValueError(f"a selection of {slots} tokens cannot hold the step's {q_len} tokens")
    device = scores.device
    b, h, _ = scores.shape
    if length <= slots:
        pad = torch.full((slots - length,), -1, dtype=torch.long)
        row = torch.cat([torch.arange(length), pad]).to(device)
        return row.expand(b, h, slots).contiguous()
    forced = _forced_positions(length, q_len, slots, sink, window).to(device)
    lo = int(forced[: min(sink, forced.numel())].numel())  # candidates start after sinks
    hi = length - (forced.numel() - lo)  # and stop before the window
    need = slots - forced.numel()
    cand = scores[..., lo:hi]
    top = cand.topk(need, dim=-1, sorted=False).indices + lo
    return torch.cat([forced.expand(b, h, -1), top], dim=-1)
