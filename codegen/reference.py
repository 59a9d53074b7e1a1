"""Plain PyTorch references for the generated kernels (test oracles; any dtype, any device).

They follow the same contract as the kernels (see ``codegen/README.md``) and compute in
``compute_dtype`` (float64 by default) so that kernel errors can be measured against them.
Not for hot paths: they gather the selection into dense tensors.
"""

from __future__ import annotations

import torch

__all__ = [
    "expand_valid_length",
    "reference_sparse_decode_attention",
]


def expand_valid_length(
    valid_length: torch.Tensor | int, batch: int, device: torch.device | None = None
) -> torch.Tensor:
    """``valid_length`` (int, ``[]`` or ``[batch]``) as an int64 ``[batch]`` tensor (a view
    with stride 0 when it was a scalar)."""
    if not isinstance(valid_length, torch.Tensor):
        valid_length = torch.tensor(int(valid_length), dtype=torch.int64, device=device)
    return (
        valid_length.reshape(-1).expand(batch)
        if valid_length.dim() == 0
        else valid_length.reshape(batch)
    )


def reference_sparse_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    indices: torch.Tensor,
    valid_length: torch.Tensor | int,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Sparse decode attention in ``compute_dtype`` (the oracle of the generated kernel).

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]``.
        value_cache: ``[batch, num_kv_heads, capacity, head_dim_v]``.
        indices: int64 ``[batch, num_kv_heads, budget]``; ``-1`` pads; entries
            ``>= valid_length`` are treated as padding here (the wrapper rejects them).
        valid_length: tokens written, ``[]`` or ``[batch]`` (this step's tokens included).
        scale: logit scale. soft_cap: optional cap. sliding_window: optional window W.

    Returns:
        ``[batch, num_heads, q_len, head_dim_v]`` in ``compute_dtype``; rows with no allowed
        position are zeros. Cache entries at unselected or invalid slots never influence it
        (NaN there does not propagate).
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    group = num_heads // num_kv
    vlen = expand_valid_length(valid_length, batch, query.device).to(query.device)
    valid = (indices >= 0) & (indices < vlen.view(batch, 1, 1))
    safe = torch.where(valid, indices, torch.zeros_like(indices))

    def gather(cache: torch.Tensor) -> torch.Tensor:
        idx = safe.unsqueeze(-1).expand(-1, -1, -1, cache.shape[-1])
        rows = cache.gather(2, idx).to(compute_dtype)
        return torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))

    keys, values = gather(key_cache), gather(value_cache)  # [b, kv, n, d]
    # scale the query before the product: in a narrow compute_dtype (float16) the raw q.k
    # may overflow while the scaled logit is small
    q = (query.to(compute_dtype) * scale).reshape(batch, num_kv, group, q_len, head_dim)
    logits = torch.einsum("bkgtd,bknd->bkgtn", q, keys)
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    rows = torch.arange(q_len, device=query.device)
    limit = vlen.view(batch, 1, 1, 1, 1) - q_len + rows.view(1, 1, 1, q_len, 1)
    pos = indices.view(batch, num_kv, 1, 1, -1)
    allowed = valid.view(batch, num_kv, 1, 1, -1) & (pos <= limit)
    if sliding_window is not None:
        allowed = allowed & (pos > limit - sliding_window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows -> zeros
    out = torch.einsum("bkgtn,bknd->bkgtd", probs, values)
    return out.reshape(batch, num_heads, q_len, values.shape[-1])
