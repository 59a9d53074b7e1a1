"""Retrieval scoring (generated Triton) and top-k selection.

SpeContext (arXiv 2512.00722), section 3.2: the retrieval head (embedding + Q/K projections
of a distilled model) scores the current query against its own key cache; for GQA the
softmax weights are reduced by element-wise max over the query heads of each KV group, then
the top-K positions per KV group form the selection shared by every LLM layer. The optional
attention-sink and recent-window tokens of ``select_topk`` are our addition, not the paper's.
"""

from __future__ import annotations

import logging
import math

import torch

from specontext_compile.codegen.attention import (
    MAX_SPLITS,
    _check_tensor,
    _prepare_valid_length,
    _require,
    _require_runnable,
)
from specontext_compile.codegen.compiler import load_kernels
from specontext_compile.codegen.spec import RetrievalSpec, canonical_dtype

__all__ = ["retrieval_scores", "select_topk"]

logger = logging.getLogger(__name__)


def _retrieval_splits(
    length: int, block_n: int, programs: int, device: torch.device, num_splits: int | None
) -> tuple[int, int]:
    blocks = max(1, math.ceil(length / block_n))
    if num_splits is None:
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 0
        )
        num_splits = math.ceil(2 * sms / max(1, programs)) if sms else 1
    num_splits = max(1, min(int(num_splits), blocks, MAX_SPLITS))
    per_split = math.ceil(blocks / num_splits)
    return math.ceil(blocks / per_split), per_split * block_n


def retrieval_scores(
    query_state: torch.Tensor,
    key_cache: torch.Tensor,
    length: int,
    *,
    scale: float | None = None,
    valid_length: torch.Tensor | int | None = None,
    num_splits: int | None = None,
    block_n: int = 0,
) -> torch.Tensor:
    """Per-KV-group importance of every cached position (generated Triton kernels).

    ``scores[b, g, n] = max_{h in group g} softmax_n(q[b, h] . k[b, g, n] * scale)`` over
    positions ``n < min(valid_length[b], length)``.

    Args:
        query_state: ``[batch, num_heads, 1, head_dim]`` retrieval-head query (RoPE applied).
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]`` retrieval-head keys, same
            dtype (fp32/bf16/fp16), any strides.
        length: positions to score, ``1 <= length <= capacity`` (a Python int: it sizes the
            output).
        scale: logit scale, default ``head_dim ** -0.5``.
        valid_length: optional int64 ``[]``/``[batch]`` written length per request
            (``<= length`` is meaningful; larger values are clamped to ``length``).
        num_splits: programs per (request, KV head) for the first phase (None = auto).
        block_n: positions per tile (0 = auto).

    Returns:
        fp32 ``[batch, num_kv_heads, length]``: weights in ``[0, 1]``; ``-inf`` at positions
        ``>= valid_length`` of that request.

    Raises:
        TypeError / ValueError: on wrong types, shapes, dtypes, devices or lengths.
        ImportError: when triton is not installed.
    """
    _check_tensor("query_state", query_state, 4)
    _check_tensor("key_cache", key_cache, 4)
    batch, num_heads, q_len, head_dim = query_state.shape
    _, num_kv, capacity, key_dim = key_cache.shape
    _require(q_len == 1, f"query_state must hold one token per head, got q_len={q_len}")
    _require(
        key_cache.shape[0] == batch and key_dim == head_dim,
        f"key_cache {tuple(key_cache.shape)} does not match query_state {tuple(query_state.shape)}",
    )
    _require(
        num_kv >= 1 and num_heads % num_kv == 0,
        f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv}",
    )
    _require(
        key_cache.dtype == query_state.dtype and key_cache.device == query_state.device,
        f"key_cache ({key_cache.dtype}, {key_cache.device}) must match query_state "
        f"({query_state.dtype}, {query_state.device})",
    )
    _require(
        isinstance(length, int) and 1 <= length <= capacity,
        f"length={length!r} must be an int in [1, capacity={capacity}]",
    )
    dtype = canonical_dtype(query_state.dtype)
    scale = head_dim**-0.5 if scale is None else float(scale)
    vlen = _prepare_valid_length(
        length if valid_length is None else valid_length, batch, query_state.device
    )
    _require_runnable(query_state.device)
    spec = RetrievalSpec(head_dim=head_dim, group=num_heads // num_kv, dtype=dtype, block_n=block_n)
    splits, split_size = _retrieval_splits(
        length, spec.block_n, batch * num_kv, query_state.device, num_splits
    )
    device = query_state.device
    logits = torch.empty((batch, num_heads, length), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=device)
    scores = torch.empty((batch, num_kv, length), dtype=torch.float32, device=device)
    logger.debug("launch %s: length=%d splits=%d", spec.name, length, splits)
    return load_kernels(spec).launch(
        query_state[:, :, 0],
        key_cache,
        vlen,
        logits,
        part_lse,
        scores,
        length=length,
        scale=scale,
        split_size=split_size,
        num_splits=splits,
    )


def select_topk(
    scores: torch.Tensor,
    budget: int,
    sink: int = 0,
    window: int = 0,
    *,
    valid_length: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Top-``budget`` positions per (request, KV head), padded with ``-1``.

    Positions ``[0, sink)`` (attention sinks) and ``[valid_length - window, valid_length)``
    (recent window, newest token included) are always kept; the rest of the budget goes to
    the highest scores among the other valid positions (``torch.topk``; the fused version did
    not pay: the scores are ``4 * length`` bytes per KV head against ``2 * head_dim * length``
    read by the scoring kernel).

    Args:
        scores: ``[batch, num_kv_heads, length]`` (higher = keep), e.g. ``retrieval_scores``.
        budget: entries per row of the returned selection (``>= 1``).
        sink: leading positions always kept. window: trailing positions always kept.
        valid_length: int64 ``[]``/``[batch]`` written length (default ``length``); positions
            at or past it are never selected.

    Returns:
        int64 ``[batch, num_kv_heads, budget]``: unique positions in ``[0, valid_length)``, in
        no particular order, ``-1`` in unused slots (when ``budget`` exceeds the context).

    Raises:
        ValueError: when ``budget < 1``, ``sink``/``window`` are negative or ``sink + window
            > budget`` (the forced tokens would not fit).
    """
    _check_tensor("scores", scores, 3)
    _require(isinstance(budget, int) and budget >= 1, f"budget={budget!r} must be an int >= 1")
    _require(sink >= 0 and window >= 0, f"sink={sink} and window={window} must be >= 0")
    _require(
        sink + window <= budget,
        f"sink + window = {sink + window} exceeds budget={budget}: the always-kept tokens "
        f"must fit in the selection; lower sink/window or raise the budget",
    )
    batch, num_kv, length = scores.shape
    vlen = _prepare_valid_length(
        length if valid_length is None else valid_length, batch, scores.device
    ).view(batch, 1, 1)
    pos = torch.arange(length, device=scores.device).view(1, 1, length)
    valid = pos < vlen
    forced = valid & ((pos < sink) | (pos >= vlen - window))
    keyed = scores.float().masked_fill(~valid, float("-inf")).masked_fill(forced, float("inf"))
    # A valid position whose score is -inf or NaN stays selectable (below every real score).
    lowest = torch.finfo(torch.float32).min
    keyed = torch.where(valid & ~forced & ~(keyed > lowest), lowest, keyed)
    top, idx = keyed.topk(min(budget, length), dim=-1, sorted=False)
    idx = idx.masked_fill(top == float("-inf"), -1)
    if idx.shape[-1] < budget:
        pad = idx.new_full((batch, num_kv, budget - idx.shape[-1]), -1)
        idx = torch.cat([idx, pad], dim=-1)
    return idx
