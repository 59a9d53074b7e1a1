"""Exact decode attention over a whole KV store, split along its slots (CPU, inductor).

The dense shortcut of a plain site (``aten_step._dense_store_attention``) reads every slot
of a layer's store. Traced for inductor on CPU as one reduction over the slots, its loops
parallelise over ``batch * num_kv_heads`` rows only: 3 rows (SmolLM2 at batch 1) on 2
threads leave a thread idle a third of the time, and the values' ``bmm`` of 3 query rows per
KV head reads the store at about half the copy rate. Here the slot axis is cut into
``chunks`` equal parts, as split-KV ("flash-decoding") GPU kernels do:

1. the keys' products, one fused reduction per ``(row, chunk, query row, slot)`` in float32
   (:func:`~.sparse_attention.row_products`' form), the causal limit and the mask;
2. one softmax over the whole store: the maximum over every chunk first, so each chunk's
   weights ``exp(logit - max)`` are the softmax numerators exactly (no rescaling);
3. the values' product per chunk as a fused reduction that adds ``UNROLL`` slots per
   iteration (independent products, a shorter dependency chain than one slot at a time),
   then the chunks' sum and the division by the softmax's denominator.

A capacity that is not a multiple of ``chunks * UNROLL`` leaves a tail of fewer slots,
attended in the same softmax by one small unsplit reduction. The result equals softmax
attention over the store up to float32 rounding (summation order only). Measured:
docs/benchmarks.md, "How the step got here".
"""

from __future__ import annotations

import torch

from . import sparse_attention
from .sparse_attention import _realized, causal_limit_mask
from .spec import AttentionVariant

__all__ = ["UNROLL", "split_chunks", "split_store_attention"]

UNROLL = 4  # slots added per iteration of the values' reduction
_TARGET_ROWS = 48  # (row, chunk) pairs that keep a few threads busy without tiny chunks
_CHUNKS = (16, 8, 4, 2)
_MIN_CHUNK_SLOTS = 32  # a smaller store is not worth splitting


def split_chunks(rows: int, capacity: int, dtype: torch.dtype = torch.float32) -> int:
    """How many chunks :func:`split_store_attention` cuts a store of ``capacity`` slots into for
    ``rows = batch * num_kv_heads``: the largest of 16, 8, 4, 2 with at most ``_TARGET_ROWS``
    (row, chunk) pairs and chunks of at least ``_MIN_CHUNK_SLOTS`` slots; 1 (no split: the
    caller keeps its unsplit body) when ``rows`` alone keeps the threads busy, the store is
    small, or its ``dtype`` is not float32 (a bfloat16 store: the split step measured 11%
    slower than the unsplit one, its per-slot conversions outweigh the balance; float32 14%
    faster: docs/benchmarks.md, "How the step got here"). Static ints only (decided at trace
    time); a symbolic size gives 1."""
    if (dtype != torch.float32 or not isinstance(capacity, int) or not isinstance(rows, int)
            or rows >= _TARGET_ROWS // 2):
        return 1
    for chunks in _CHUNKS:
        if rows * chunks <= _TARGET_ROWS and capacity >= chunks * _MIN_CHUNK_SLOTS:
            return chunks
    return 1


def _allowed(length: torch.Tensor, attn_mask: torch.Tensor | None, q_len: int, capacity: int,
             device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(allowed, additive)``: bool ``[b|1, h|1, q_len, capacity]`` (causal limit, a boolean
    mask's visible slots) and a float additive mask of that shape or None."""
    pos = torch.arange(capacity, device=device).view(1, 1, capacity)
    allowed = causal_limit_mask(pos, length, q_len)  # [b|1, 1, q, capacity]
    if attn_mask is None:
        return allowed, None
    mask = attn_mask[..., :capacity]
    if mask.dtype == torch.bool:
        return allowed & mask, None
    return allowed, mask.float()


def _masked(logits: torch.Tensor, allowed: torch.Tensor, additive: torch.Tensor | None, num_kv: int,
            groups: int, chunks: int) -> torch.Tensor:
    """``logits`` ``[b, kv, chunks, g, q, slots]`` (``chunks`` 0: ``[b, kv, g, q, slots]``) with
    the additive mask added and ``-inf`` where ``allowed`` (``[b|1, h|1, q, chunks * slots]``,
    this part of the store; ``h`` = ``num_kv * groups`` query heads, or 1) is False."""
    def shaped(t):
        b, h, q_len, n = t.shape
        t = t.reshape(b, num_kv, groups, q_len, n) if h > 1 else t.unsqueeze(1)  # [b, kv|1, g|1, q, n]
        if not chunks:
            return t
        return t.reshape(*t.shape[:4], chunks, n // chunks).permute(0, 1, 4, 2, 3, 5)

    if additive is not None:
        logits = logits + shaped(additive)
    return logits.masked_fill(~shaped(allowed), float("-inf"))


def split_store_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          length: torch.Tensor, attn_mask: torch.Tensor | None, variant: AttentionVariant,
                          chunks: int) -> torch.Tensor:
    """Softmax attention of ``query`` over every slot of the store a plain site may see (the
    causal limit ``p <= length - q_len + r`` and the mask), computed in ``chunks`` equal parts
    of the slot axis plus a tail of fewer than ``chunks * UNROLL`` slots (module docstring).
    Meant for a trace for inductor on CPU: eager, it materialises ``[batch, num_kv_heads,
    chunks, rows, slots, head_dim]``.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key_cache, value_cache: ``[batch, num_kv_heads, capacity, head_dim(_v)]``; slots at or
            after ``length`` are never attended.
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included.
        attn_mask: None or a Hugging Face mask ``[batch|1, 1|num_heads, q_len, capacity']``
            (``capacity' >= capacity``), bool (True = attend) or additive float.
        variant: a plain site's (``variant.plain``): ``scale`` and ``fused_products`` are read.
        chunks: from :func:`split_chunks` (at least 2); ``capacity >= chunks * UNROLL``.

    Returns:
        ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype`` (softmax and sums in
        float32); a row that may see no slot is all zeros.

    Raises:
        ValueError: when ``chunks < 2`` or the store has fewer than ``chunks * UNROLL`` slots.
    """
    b, num_heads, q_len, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    if chunks < 2 or capacity < chunks * UNROLL:
        raise ValueError(f"a store of {capacity} slots does not split into {chunks} chunks of at least "
                         f"{UNROLL} slots: choose chunks with split_chunks()")
    groups, rows = num_heads // num_kv, (num_heads // num_kv) * q_len
    main = capacity - capacity % (chunks * UNROLL)
    slots = main // chunks
    # written once to a buffer of its own, not recomputed (rotary, scale) once per key
    q = _realized((query.float() * variant.scale).reshape(b, num_kv, rows, head_dim))
    allowed, additive = _allowed(length, attn_mask, q_len, capacity, query.device)
    keys = key_cache[:, :, :main].reshape(b, num_kv, chunks, 1, slots, head_dim)
    logits = (q.view(b, num_kv, 1, rows, 1, head_dim) * keys.float()).sum(-1)
    logits = _masked(logits.view(b, num_kv, chunks, groups, q_len, slots), allowed[..., :main],
                     None if additive is None else additive[..., :main], num_kv, groups, chunks)
    logits = sparse_attention.logits_once(logits, q, keys, variant.fused_products)  # read by the max, sum and values
    # two-stage reductions (within a chunk, then over chunks): inductor keeps the chunk axis
    # among its parallel loops
    top = logits.amax(dim=5).amax(dim=2)  # [b, kv, g, q]
    tail = None
    if main < capacity:
        tail = (q.view(b, num_kv, rows, 1, head_dim) * key_cache[:, :, main:].float().unsqueeze(2)).sum(-1)
        tail = _masked(tail.view(b, num_kv, groups, q_len, -1), allowed[..., main:],
                       None if additive is None else additive[..., main:], num_kv, groups, 0)
        top = torch.maximum(top, tail.amax(dim=-1))
    top = torch.where(top == float("-inf"), 0.0, top)
    weights = torch.exp(logits - top[:, :, None, :, :, None])
    total = weights.sum(dim=5).sum(dim=2)  # [b, kv, g, q]
    out = _weighted_values(weights.view(b, num_kv, chunks, rows, slots), value_cache[:, :, :main], chunks)
    if tail is not None:
        tail = torch.exp(tail - top[..., None])
        total = total + tail.sum(dim=-1)
        values = value_cache[:, :, main:].float().unsqueeze(2)  # [b, kv, 1, t, dv]
        out = out + (tail.view(b, num_kv, rows, -1, 1) * values).sum(dim=-2)
    out = (out / total.view(b, num_kv, rows, 1)).nan_to_num(0.0)
    return out.view(b, num_heads, q_len, value_cache.shape[-1]).to(query.dtype)


def _weighted_values(weights: torch.Tensor, value_cache: torch.Tensor, chunks: int) -> torch.Tensor:
    """float32 ``[b, kv, rows, dv]``: ``sum_s weights[..., s] * values[s]`` over every chunk,
    ``weights`` ``[b, kv, chunks, rows, slots]``, ``value_cache`` ``[b, kv, chunks * slots,
    dv]``; the reduction adds :data:`UNROLL` slots per step."""
    b, num_kv, _, rows, slots = weights.shape
    dv = value_cache.shape[-1]
    values = value_cache.reshape(b, num_kv, chunks, 1, slots // UNROLL, UNROLL, dv).float()
    w = weights.view(b, num_kv, chunks, rows, slots // UNROLL, UNROLL, 1)
    acc = w[..., 0, :] * values[..., 0, :]
    for j in range(1, UNROLL):
        acc = acc + w[..., j, :] * values[..., j, :]
    return acc.sum(dim=4).sum(dim=2)
