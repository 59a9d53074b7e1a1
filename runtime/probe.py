"""Optional measurement hooks read by the runtime ops (off unless a caller turns them on).

:func:`recall_probe` makes every sparse attention call in its ``with`` block also compute the
dense attention of the same query over every written token and record the share of that
attention mass that falls inside the selection ("attention recall", the fidelity measure of
docs/design.md). It costs a dense attention per layer, so callers switch it on for a few
sampled decode steps only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch

from .sparse_attention import causal_limit_mask

__all__ = ["RecallRecord", "active_probe", "recall_probe", "record_recall"]

_state = threading.local()


@dataclasses.dataclass
class RecallRecord:
    """Recall per sparse-attention call, in call order (one per rewritten layer).

    ``values[i]`` is the mean over batch, query heads and query rows of the dense attention
    probability mass inside the selection (a float in [0, 1]).
    """

    values: list[float] = dataclasses.field(default_factory=list)

    def mean(self) -> float:
        """Mean recall over the recorded calls; ``nan`` when none were recorded."""
        return sum(self.values) / len(self.values) if self.values else float("nan")


def active_probe() -> RecallRecord | None:
    """The probe of the current thread's innermost ``recall_probe`` block, if any."""
    return getattr(_state, "probe", None)


@contextlib.contextmanager
def recall_probe() -> Iterator[RecallRecord]:
    """Record attention recall for every sparse attention call inside the block."""
    record, previous = RecallRecord(), active_probe()
    _state.probe = record
    try:
        yield record
    finally:
        _state.probe = previous


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

    Shapes as in :func:`~specontext_compile.runtime.sparse_attention.sparse_attention_reference`.
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
    # last column: padding slots (-1)
    chosen = torch.zeros(b, num_kv, length + 1, dtype=torch.bool, device=key_cache.device)
    chosen.scatter_(2, torch.where(indices >= 0, indices, length), True)
    mass = (probs * chosen[..., :length].view(b, num_kv, 1, 1, length)).sum(-1)
    return float(mass.nan_to_num(0.0).mean())


def record_recall(query: torch.Tensor, key_cache: torch.Tensor, indices: torch.Tensor, length: torch.Tensor,
                  attn_mask: torch.Tensor | None, variant, dense: torch.Tensor | None = None) -> None:
    """Inside a :func:`recall_probe` block, record one site's :func:`selection_recall` (1.0
    when the fidelity guard's ``dense`` ran it densely); else nothing. Called by the
    attention ops and by the step functions the pass calls directly for guarded and
    learned-sink sites, when they run eagerly (under tracing no probe is active).
    ``variant``: the site's :class:`~.spec.AttentionVariant`."""
    probe = active_probe()
    if probe is not None:
        probe.values.append(1.0 if dense is not None and bool(dense) else
                            selection_recall(query, key_cache, indices, int(length), variant.scale, attn_mask,
                                             variant.soft_cap, variant.sliding_window))
