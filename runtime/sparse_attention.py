"""Sparse decode attention over a selection of cached tokens: the CPU (torch) path.

Each (request, KV head) attends only to the token positions its selection names
(SpeContext, arXiv 2512.00722, section 4: "head-level" selection shared by every layer).
The computation equals dense attention restricted to the selected positions, with the same
causal limit and the same additive or boolean mask, so with a selection that covers every
written position it equals dense attention exactly (up to float rounding).
"""

from __future__ import annotations


import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .spec import AttentionVariant
from .torch_private import force_stride_order

__all__ = ["attend_gathered", "group_max_probs", "masked_group_max_softmax", "row_visibility", "causal_limit_mask", "selected_logits", "query_key_logits", "row_products",
           "sparse_attention_reference"]


def query_key_logits(query: torch.Tensor, keys: torch.Tensor, scale: float, fused: bool = False) -> torch.Tensor:
    """float32 logits ``(query * scale) @ keys^T``: the query is scaled *before* the product.

    In float16 the raw product ``q . k`` can exceed 65504 (head_dim 128, entries ~24) while
    the scaled logit is small; a product formed before the scale overflows to inf (a row of
    NaN, then zero weights). Scaling the query first (in float32, rounded once to the key
    dtype, as SDPA's math path does) is cheap: ``query`` is one row per head at decode. The
    matmul accumulates in float32 where the backend does (CUDA, CPU). For float32 inputs the
    result differs from ``(q @ k^T) * scale`` by rounding only (~1e-7 relative). The selection
    nodes use it too (:mod:`~specontext_compile.runtime.aten_step`), so both paths score
    identically.

    Args:
        query: ``[..., rows, head_dim]``.
        keys: ``[..., n, head_dim]`` (broadcast like ``matmul``).
        scale: softmax scale.
        fused: the product as a fused reduction where :func:`fused_products` allows it (the
            site's ``AttentionVariant.fused_products``).

    Returns:
        float32 ``[..., rows, n]``.
    """
    q = (query.float() * scale).to(keys.dtype)
    return row_products(q, keys, fused)


def row_products(rows: torch.Tensor, keys: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """float32 ``rows @ keys^T``: ``rows`` ``[..., r, d]``, ``keys`` ``[..., n, d]`` (broadcast
    like ``matmul``), same dtype. A matmul, or, with ``fused`` in a CPU decode step
    (:func:`fused_products`), ``[..., r, 1, d] * [..., 1, n, d]`` summed over ``d`` in float32:
    one reduction that inductor fuses with whatever produced ``keys`` (a gather from the KV
    store: no gathered copy written and read again). For float32 inputs the two differ by
    summation order only; for bfloat16 / float16 inputs the matmul rounds each result to
    that dtype and the fused sum keeps it in float32 (closer to float64's)."""
    if fused_products(rows, keys, fused):
        chunks = product_chunks(rows, keys)
        if chunks > 1:  # [..., chunks, r, n / chunks], read back as [..., r, n]
            *lead, n, d = keys.shape
            parts = (_realized(rows.float()).unsqueeze(-3).unsqueeze(-2)
                     * keys.float().reshape(*lead, chunks, 1, n // chunks, d)).sum(-1)
            return parts.movedim(-3, -2).reshape(*lead, rows.shape[-2], n)
        return (_realized(rows.float()).unsqueeze(-2) * keys.float().unsqueeze(-3)).sum(-1)
    return torch.matmul(rows, keys.transpose(-1, -2)).float()


def product_chunks(rows: torch.Tensor, keys: torch.Tensor) -> int:
    """In how many chunks of its keys a fused :func:`row_products` runs: the loops of a fused
    product parallelise over its leading dims (``batch * num_kv_heads``), 3 items for SmolLM2
    at batch 1 on 2 threads; cutting the ``n`` keys into chunks gives the threads more
    (the split store attention's reason, :mod:`.split_store`). The largest of 16, 8, 4, 2
    that divides ``n`` into chunks of at least 32 keys with at most 48 (item, chunk) pairs,
    for float32 or bfloat16 keys (measured: the default's step 3% and 2% faster; float16 not
    measured) whose leading dims equal the rows' (no broadcast); else 1. Static shapes only."""
    *lead, n, _ = keys.shape
    items = 1
    for size in lead:
        items *= size
    if (keys.dtype not in (torch.float32, torch.bfloat16) or list(rows.shape[:-2]) != lead or not isinstance(n, int)
            or not isinstance(items, int) or items >= 24):
        return 1
    for chunks in (16, 8, 4, 2):
        if n % chunks == 0 and n // chunks >= 32 and items * chunks <= 48:
            return chunks
    return 1


def _realized(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` written to a buffer of its own in the compiled step (inductor's
    ``force_stride_order``), so that the fused product reads it instead of recomputing
    whatever produced it (the rotary embedding, the scale, casts) once per key: at decode a
    few hundred floats written once against work repeated for thousands of keys
    (``python -m benchmarks.layer_step --realized``). Only in a fused product (traced for inductor)."""
    if not REALIZE_ROWS or rows.requires_grad:  # the prim has no autograd formula (a step traced with grad)
        return rows
    rows = rows.contiguous()
    return force_stride_order(rows, rows.stride())


# query rows up to which a traced CPU product is a fused reduction instead of a matmul
FUSED_PRODUCT_ROWS = 16

# whether a fused product's rows are written to a buffer first (:func:`_realized`); read at
# trace time (benchmarks.layer_step --realized traces with it off for the comparison)
REALIZE_ROWS = True


def fused_products(rows: torch.Tensor, keys: torch.Tensor, fused: bool) -> bool:
    """Whether :func:`row_products` sums in a fused reduction: ``fused`` (the site's
    ``AttentionVariant.fused_products``, which the lowering sets in a graph inductor compiles)
    for CPU tensors when ``rows`` has at most :data:`FUSED_PRODUCT_ROWS` rows (a decode step's
    query rows per KV head). There
    ``(q * k).sum(-1)`` compiles to one vectorised loop that reads each gathered key once,
    where ``index_select`` then ``bmm`` writes the gathered keys and reads them again, in two
    calls (measured: docs/benchmarks.md, "How the step got here"). Everything else keeps
    the matmul: eager runs (the op chain, ``inner="eager"``, an eager ``torch.cond``, which
    dynamo traces with its eager backend), where the product would be materialised;
    prefill-sized rows (the matmul's blocking); CUDA (cuBLAS, not measured there)."""
    return fused and keys.device.type == "cpu" and statically_known_true(rows.shape[-2] <= FUSED_PRODUCT_ROWS)


def causal_limit_mask(
    indices: torch.Tensor, length: torch.Tensor, q_len: int, sliding_window: int = 0
) -> torch.Tensor:
    """Which selected positions each query row may attend to.

    Args:
        indices: ``[batch, num_kv_heads, budget]`` int64 token positions; ``-1`` marks a
            padding slot.
        length: int64 tensor, shape ``[]`` or ``[batch]``: tokens written in the cache,
            counting this step's ``q_len`` new tokens.
        q_len: query tokens in this step.
        sliding_window: 0 for full causal attention; else row ``r`` also needs
            ``p > length - q_len + r - sliding_window`` (Hugging Face's sliding window).

    Returns:
        bool ``[batch, num_kv_heads, q_len, budget]``: row ``r`` may see position ``p`` iff
        ``0 <= p <= length - q_len + r`` (and inside the sliding window, if any).
    """
    rows = torch.arange(q_len, device=indices.device)
    length = length.reshape(-1, 1, 1, 1) if length.dim() else length
    limit = length - q_len + rows.view(1, 1, q_len, 1)  # [b|1, 1, q_len, 1]
    idx = indices.unsqueeze(2)  # [batch, kv, 1, budget]
    allowed = (idx >= 0) & (idx <= limit)
    if sliding_window > 0:
        allowed = allowed & (idx > limit - sliding_window)
    return allowed


def _gather_tokens(cache: torch.Tensor, safe_idx: torch.Tensor) -> torch.Tensor:
    """Gather ``[batch, kv, budget, dim]`` rows of ``cache`` ``[batch, kv, capacity, dim]``.

    A contiguous store is read as whole rows (one ``index_select`` over
    ``batch * kv * capacity`` rows); other layouts fall back to an element-wise gather.
    """
    b, h, k = safe_idx.shape
    capacity, dim = cache.shape[2], cache.shape[3]
    if cache.is_contiguous():
        base = torch.arange(b * h, device=safe_idx.device).view(b, h, 1) * capacity
        rows = (base + safe_idx).reshape(-1)
        return cache.view(b * h * capacity, dim).index_select(0, rows).view(b, h, k, dim)
    return cache.gather(2, safe_idx.unsqueeze(-1).expand(b, h, k, dim))


def _gather_mask(attn_mask: torch.Tensor, safe_idx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Gather a HF mask ``[batch|1, 1|heads, q_len, capacity]`` at the selected positions.

    Returns ``[batch, num_kv_heads, groups, q_len, budget]`` (groups is 1 when the mask has
    one head, so it broadcasts over the query heads of a group).
    """
    b, h, k = safe_idx.shape
    mb, mh, q_len, _ = attn_mask.shape
    if mh == 1:
        src = attn_mask.expand(b, h, q_len, attn_mask.shape[-1])
        idx = safe_idx.unsqueeze(2).expand(b, h, q_len, k)
        return src.gather(3, idx).unsqueeze(2)
    groups = mh // num_kv_heads
    src = attn_mask.expand(b, mh, q_len, attn_mask.shape[-1]).view(b, h, groups, q_len, -1)
    idx = safe_idx.view(b, h, 1, 1, k).expand(b, h, groups, q_len, k)
    return src.gather(4, idx)


def sparse_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    indices: torch.Tensor,
    length: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    variant: AttentionVariant | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the selected cached tokens only.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]`` (positions ``>= length``
            may hold garbage: they are never attended to).
        value_cache: ``[batch, num_kv_heads, capacity, head_dim_v]``.
        indices: ``[batch, num_kv_heads, budget]`` int64 positions, unique per row, any
            order, ``-1`` for padding.
        length: int64 scalar (or ``[batch]``) tensor: tokens written, this step's included.
        attn_mask: optional HF mask ``[batch|1, 1|num_heads, q_len, capacity]``, bool
            (True = attend) or additive float.
        variant: the site's :class:`~.spec.AttentionVariant`: ``scale`` (softmax scale),
            ``soft_cap`` (Gemma 2: scores become ``soft_cap * tanh(scores * scale / soft_cap)``
            before the mask; None = off), ``sliding_window`` (0 = full causal attention; else
            positions outside each row's last ``sliding_window`` tokens are never attended,
            :func:`causal_limit_mask`). None: plain attention at ``head_dim ** -0.5``.
        sinks: optional learned sink logit per query head ``[num_heads]`` (GPT-OSS): one
            more softmax column that takes probability mass and contributes no value.

    Returns:
        ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype`` (softmax in float32).
        A row that may see no selected position is all zeros, never NaN.

    Raises:
        ValueError: when ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    b, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv}")
    variant = AttentionVariant(scale=head_dim**-0.5) if variant is None else variant
    safe_idx = indices.clamp(min=0)
    keys = _gather_tokens(key_cache, safe_idx)  # [b, kv, k, d]
    values = _gather_tokens(value_cache, safe_idx)
    return attend_gathered(query, keys, values, indices, length, attn_mask, variant, sinks)


def selected_logits(
    query: torch.Tensor,
    keys: torch.Tensor,
    indices: torch.Tensor,
    length: torch.Tensor,
    attn_mask: torch.Tensor | None,
    variant: AttentionVariant,
) -> torch.Tensor:
    """The logits a layer's attention gives the selected tokens, exactly as it computes them:
    ``query * scale`` before the product (:func:`query_key_logits`), the soft cap, the mask
    (additive, or boolean with the causal limit and the sliding window), ``-inf`` where a
    row may not look (``-1`` padding included). Shared by the attention output
    (:func:`attend_gathered`) and the per-layer refinement of the two-stage selection, so
    both score a token identically.

    Args: ``query`` ``[batch, num_heads, q_len, head_dim]``, ``keys`` ``[batch,
    num_kv_heads, k, head_dim]`` (rows of ``indices`` ``[batch, num_kv_heads, k]``), the rest
    as in :func:`sparse_attention_reference`.

    Returns:
        float32 ``[batch, num_kv_heads, groups, q_len, k]``.
    """
    b, num_heads, q_len, head_dim = query.shape
    num_kv = keys.shape[1]
    groups = num_heads // num_kv
    q = query.reshape(b, num_kv, groups * q_len, head_dim)
    logits = query_key_logits(q, keys, variant.scale, variant.fused_products)  # float32; no fp16 overflow
    if variant.soft_cap is not None:
        logits = torch.tanh(logits / variant.soft_cap) * variant.soft_cap
    logits = logits.view(b, num_kv, groups, q_len, -1)
    allowed = causal_limit_mask(indices, length, q_len, variant.sliding_window).unsqueeze(2)  # [b, kv, 1, q, k]
    if attn_mask is not None:
        gathered = _gather_mask(attn_mask, indices.clamp(min=0), num_kv)
        if gathered.dtype == torch.bool:
            allowed = allowed & gathered
        else:
            logits = logits + gathered.float()
    return logits_once(logits.masked_fill(~allowed, float("-inf")), q, keys, variant.fused_products)


def logits_once(logits: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, fused: bool) -> torch.Tensor:
    """``logits`` written to a buffer of its own when they come from a fused product of ``rows``
    and ``keys`` (:func:`fused_products`): their consumers (a softmax's max, sum and scaling
    passes, the refinement's ranking) read them several times, and inductor would otherwise
    fuse the product, the mask's gather and the chunk layout's index arithmetic into each of
    those passes (a few hundred KB written once against that work repeated: at 8K the
    default's step 5% faster, own dense in bfloat16 7%; ``python -m benchmarks.ab_step --swap
    unrealized``, docs/benchmarks.md)."""
    return _realized(logits) if fused_products(rows, keys, fused) else logits


def attend_gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    length: torch.Tensor,
    attn_mask: torch.Tensor | None,
    variant: AttentionVariant,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The part of sparse attention after the gather (shared by the offloaded path).

    ``keys``/``values`` ``[batch, num_kv_heads, budget, dim]`` are the rows of the positions
    in ``indices`` (any source: the store, or an offload device buffer); the other arguments
    and the result are as in :func:`sparse_attention_reference`.
    """
    b, num_heads, q_len, _ = query.shape
    num_kv = keys.shape[1]
    logits = selected_logits(query, keys, indices, length, attn_mask, variant)
    if sinks is not None:  # one more column per head: it takes mass, adds no value
        column = sinks.float().view(1, num_kv, -1, 1, 1).expand(*logits.shape[:4], 1)
        logits = torch.cat([logits, column], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)
    else:
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).to(values.dtype)
    out = torch.matmul(probs.view(b, num_kv, (num_heads // num_kv) * q_len, -1), values)
    return out.view(b, num_heads, q_len, values.shape[-1]).to(query.dtype)


def row_visibility(attn_mask: torch.Tensor | None, capacity: int) -> torch.Tensor | None:
    """Which store positions each batch row may attend to at all, read from a Hugging Face
    attention mask ``[batch|1, 1|heads, q_len, >= capacity]`` (bool, True = attend, or
    additive float: hidden where ``-inf`` or below half the dtype's minimum, visible
    otherwise, a finite bias included): its last query row, first head. Left padding hides a
    row's pad positions there. Returns bool ``[batch|1, 1, capacity]``, or None for no mask."""
    if attn_mask is None:
        return None
    last = attn_mask[:, :1, -1, :capacity]  # [b, 1, capacity]
    # additive masks: hidden = -inf or the dtype's minimum; other values (0, or a finite bias
    # such as Doge's dynamic mask) are visible
    last = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    if last.shape[-1] < capacity:  # a mask narrower than the store hides the rest
        last = torch.nn.functional.pad(last, (0, capacity - last.shape[-1]), value=False)
    return last


def masked_group_max_softmax(query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                             scale: float, rope_keys: torch.Tensor | None = None,
                             position_bias: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """Per-KV-group attention weights of one query row over the allowed positions.

    Args:
        query: ``[batch, num_heads, 1, head_dim]``.
        keys: ``[batch, num_kv_heads, capacity, head_dim]`` (disallowed slots may hold garbage).
        allowed: bool ``[capacity]`` or ``[batch|1, 1, capacity]``: the positions the softmax
            runs over (per batch row: padding-aware).
        scale: softmax scale (applied to the query before the product, see
            :func:`~specontext_compile.runtime.sparse_attention.query_key_logits`).
        rope_keys: MLA only (:mod:`.mla`): the rotary key store ``[batch, 1, capacity, p]``;
            the key is then ``[keys ; rope_keys]`` and ``query`` is the absorbed query
            ``[batch, num_heads, 1, head_dim + p]`` (no concatenated copy of the stores).
        fused: the products as fused reductions (:func:`fused_products`; the selection
            variant's ``fused_products``).

    Returns:
        float32 ``[batch, num_kv_heads, capacity]``: max over the query heads of each group
        of ``softmax(q . K * scale)`` (paper section 4, GQA mapping); 0 where not allowed.
    """
    b, num_kv, _, d = keys.shape
    q = query.reshape(b, num_kv, -1, query.shape[-1])
    logits = query_key_logits(q[..., :d], keys, scale, fused)  # [b, kv, g, cap]
    if rope_keys is not None:
        logits = logits + query_key_logits(q[..., d:], rope_keys, scale, fused)
    if position_bias is not None:
        logits = logits + position_bias.float().reshape(position_bias.shape[0], num_kv, -1, logits.shape[-1])
    return group_max_probs(logits, allowed)


def group_max_probs(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The selection heads' per-KV-group weights from their logits (paper section 4, GQA):
    ``softmax`` of ``logits`` float32 ``[batch, num_kv_heads, group, capacity]`` over the
    ``allowed`` positions (bool ``[capacity]`` or ``[batch|1, 1, capacity]``), max over the
    group's query heads. Returns float32 ``[batch, num_kv_heads, capacity]``, 0 where not
    allowed (no NaN when nothing is)."""
    probs = torch.softmax(logits.masked_fill(~allowed.unsqueeze(-2), float("-inf")), dim=-1).amax(dim=2)
    return torch.where(allowed, probs, 0.0)
