"""Sparse decode attention in Triton: the kernels themselves (issue 53, item 3).

SpeContext (Xu et al., ASPLOS 2026, arXiv 2512.00722), section 4: every layer of the LLM
attends only to the token positions the retrieval head selected. Flash-decoding in two phases:

* ``sparse_decode_split_kernel`` (and ``sparse_mla_split_kernel`` for multi-head latent
  attention, section 3.2's MLA mapping), grid ``(batch, num_kv_heads * ROW_TILES,
  num_splits)``: the ``GROUP * Q_LEN`` query rows of one KV head form one tile; the program
  walks its share of the selection in ``BLOCK_N`` blocks (gather K, ``q @ k^T``, optional
  soft cap, causal/window mask, online softmax, gather V, ``p @ v``) and writes an fp32
  partial output and its log-sum-exp.
* ``sparse_decode_merge_kernel``, grid ``(batch, num_heads, q_len)``: log-sum-exp merge of
  the splits, cast to the output's dtype.

Everything a site changes is a ``tl.constexpr`` argument (sizes, GQA group, ``q_len``, soft
cap, window, the dot's precision), set from a :class:`~.spec.KernelSpec` by
:func:`~.launch.launch`; Triton compiles and caches one binary per distinct set. The argument
and layout contract is ``codegen/README.md``'s.

Invariants (each checked by ``tests/test_codegen_*.py``):

- program ids are promoted to int64 before any multiplication by a stride, and gathered
  offsets are ``int64(pos) * stride`` (:func:`gather_offsets`);
- a cache slot at or past ``valid_length`` (or a ``-1`` padding entry) is never loaded;
- a row with no allowed position yields zeros, never NaN;
- float arguments are cast to fp32 first (inductor passes a Python float as fp64 on CUDA);
- interpreter-safe (``TRITON_INTERPRET=1``): reductions go through :func:`sum_along` /
  :func:`max_along` and bf16 dot operands are upcast under the interpreter
  (``DOT_UPCAST``), see below.

This file is loaded once per Triton mode (compiled, interpreted) by
:func:`~.launch.kernel_module`: ``@triton.jit`` picks the mode when it decorates, and the
reductions below differ between the two.
"""

import os

import triton
import triton.language as tl

# Reductions. Under the interpreter (TRITON_INTERPRET=1) ``tl.sum``/``tl.max`` are jit
# functions bound when triton.language was first imported; if that happened before the
# variable was set, the interpreter cannot call them, so there a reduction is the builtin
# ``tl.reduce`` with triton's own combiners, which the interpreter maps to numpy. Compiled
# kernels call ``tl.sum``/``tl.max``: inductor copies a user kernel's jit dependencies into
# its own module by their source (``wrap_triton``), and triton's combiners name globals of
# triton's module (``core``) that the copy does not have.
if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes"):
    from triton.language.standard import _elementwise_max, _sum_combine

    @triton.jit
    def sum_along(x, axis: tl.constexpr):
        """``tl.sum(x, axis)`` as the reduce it is, with triton's own combiner."""
        return tl.reduce(x, axis, _sum_combine)

    @triton.jit
    def max_along(x, axis: tl.constexpr):
        """``tl.max(x, axis)`` for float tiles (see ``sum_along``)."""
        return tl.reduce(x, axis, _elementwise_max)
else:
    @triton.jit
    def sum_along(x, axis: tl.constexpr):
        """``tl.sum(x, axis)``."""
        return tl.sum(x, axis)

    @triton.jit
    def max_along(x, axis: tl.constexpr):
        """``tl.max(x, axis)``."""
        return tl.max(x, axis)


@triton.jit
def dot_f32(a, b, DOT_IEEE: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b`` with a float32 result (``tl.dot``'s default ``out_dtype``).

    ``DOT_IEEE``: exact fp32 products (``input_precision="ieee"``: no silent TF32 on GPUs),
    set for fp32 storage. ``DOT_UPCAST``: Triton 3.x's interpreter multiplies bf16 tiles as
    raw 16-bit integers, so under the interpreter bf16 operands are upcast to fp32 first
    (exact: bf16 is a subset of fp32), which gives the values a GPU computes; compiled
    kernels keep native bf16/fp16 tensor-core dots. Callers apply ``scale`` to the float32
    result, so an fp16 ``q . k`` above 65504 never overflows (tests/test_numerics.py)."""
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if DOT_IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def gather_offsets(pos, offs_d, stride_c, stride_d):
    """int64 element offsets ``pos * stride_c + d * stride_d`` of a gathered [N, D] tile.

    ``pos`` is int64 (token positions loaded from the selection), so the product cannot wrap
    at 2**31 even on stores of more than 131072 tokens x 16384 elements.
    """
    return pos.to(tl.int64)[:, None] * stride_c + offs_d.to(tl.int64)[None, :] * stride_d


@triton.jit
def tanh_f32(x):
    """tanh in fp32 from exp (portable to the interpreter); exact to rounding at |x| > 15."""
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    e = tl.exp(2.0 * x)
    return (e - 1.0) / (e + 1.0)


@triton.jit
def split_program(ROW_TILES: tl.constexpr, GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """This phase-1 program's request, split and KV head (program ids promoted to int64 before
    any multiplication by a stride) and its query rows (:func:`query_rows`). Returns
    ``(pid_b, pid_s, pid_kvh, row_ok, row_t, heads)``."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_hr = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    pid_kvh = pid_hr // ROW_TILES
    row_ok, row_t, heads = query_rows(pid_hr % ROW_TILES, pid_kvh, GROUP, Q_LEN, BLOCK_M)
    return pid_b, pid_s, pid_kvh, row_ok, row_t, heads


@triton.jit
def causal_limits(vlen_ptr, vlen_stride_b, pid_b, row_t, window, Q_LEN: tl.constexpr):
    """Causal limit of row (head, t): position p is allowed iff p <= valid_length - Q_LEN + t
    (and p > that limit - window with a sliding window). Returns ``(valid_length, limit,
    lower)``."""
    valid_length = tl.load(vlen_ptr + pid_b * vlen_stride_b)
    limit = valid_length - Q_LEN + row_t
    return valid_length, limit, limit - window


@triton.jit
def selection_block(idx_base, idx_stride_n, n0, end, valid_length, BLOCK_N: tl.constexpr):
    """Positions ``pos`` of selection entries ``n0 .. n0 + BLOCK_N`` (``-1`` past ``end``) and
    which of them may be loaded: ``-1`` pads the selection, and slots at or past
    ``valid_length`` may be uninitialised memory, never loaded. Returns ``(pos, pos_ok)``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    pos = tl.load(idx_base + offs_n * idx_stride_n, mask=offs_n < end, other=-1)
    return pos, (pos >= 0) & (pos < valid_length)


@triton.jit
def gather_rows(base, pos, pos_ok, offs, ok, stride_c, stride_d):
    """The ``[BLOCK_N, len(offs)]`` tile of a store's rows ``pos`` (columns ``offs`` where
    ``ok``); rows with ``pos_ok`` false are not read and hold 0."""
    return tl.load(base + gather_offsets(pos, offs, stride_c, stride_d),
                   mask=pos_ok[:, None] & ok[None, :], other=0.0)


@triton.jit
def query_rows(pid_r, pid_kvh, GROUP: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: the GROUP query heads of KV head ``pid_kvh`` x Q_LEN tokens,
    head-major. Returns ``(row_ok, row_t, heads)``, each ``[BLOCK_M]``."""
    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Q_LEN
    row_t = rows % Q_LEN
    heads = pid_kvh * GROUP + rows // Q_LEN
    return row_ok, row_t, heads


@triton.jit
def load_rows(ptr, stride_b, stride_h, stride_t, stride_d, pid_b, heads, row_t, row_ok, offs, ok):
    """A ``[BLOCK_M, len(offs)]`` tile of a ``[batch, heads, q_len, width]`` tensor: row
    ``(heads[i], row_t[i])`` of request ``pid_b``, columns ``offs`` where ``ok``; 0 elsewhere."""
    rows = ptr + pid_b * stride_b + heads[:, None] * stride_h + row_t[:, None] * stride_t
    return tl.load(rows + offs[None, :] * stride_d, mask=row_ok[:, None] & ok[None, :], other=0.0)


@triton.jit
def softmax_block(s, pos, pos_ok, limit, lower, m_i, l_i, soft_cap,
                  HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One block of the online softmax over logits ``s`` ``[BLOCK_M, BLOCK_N]`` (already
    scaled) of positions ``pos``: soft cap, causal limit (``pos <= limit`` per row) and window
    (``pos > lower``), then the running max ``m_i`` and sum ``l_i``.

    Returns ``(p, alpha, m_new, l_new)``: the block's unnormalised probabilities, the factor
    that rescales what was accumulated before, and the new running statistics. ``m_ref``
    keeps rows that have seen nothing allowed free of NaN."""
    if HAS_SOFT_CAP:
        s = soft_cap * tanh_f32(s / soft_cap)
    allowed = pos_ok[None, :] & (pos[None, :] <= limit[:, None])
    if HAS_WINDOW:
        allowed = allowed & (pos[None, :] > lower[:, None])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, max_along(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_new = l_i * alpha + sum_along(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def store_partials(acc, m_i, l_i, part_out_ptr, part_lse_ptr,
                   po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
                   pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
                   pid_b, pid_s, heads, row_t, row_ok, offs_dv, dv_ok):
    """Write the split's normalised output (fp32) and its log-sum-exp (-inf when the split
    held no allowed position; its output is then zeros)."""
    has_any = l_i > 0.0
    l_ref = tl.where(has_any, l_i, 1.0)
    out = acc / l_ref[:, None]
    lse = tl.where(has_any, m_i + tl.log(l_ref), float("-inf"))
    po_rows = (part_out_ptr + pid_b * po_stride_b + heads[:, None] * po_stride_h
               + row_t[:, None] * po_stride_t + pid_s * po_stride_s)
    tl.store(po_rows + offs_dv[None, :] * po_stride_d, out, mask=row_ok[:, None] & dv_ok[None, :])
    pl_rows = (part_lse_ptr + pid_b * pl_stride_b + heads * pl_stride_h
               + row_t * pl_stride_t + pid_s * pl_stride_s)
    tl.store(pl_rows, lse, mask=row_ok)


@triton.jit
def sparse_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, vlen_ptr, part_out_ptr, part_lse_ptr,
    q_stride_b, q_stride_h, q_stride_t, q_stride_d,
    k_stride_b, k_stride_h, k_stride_c, k_stride_d,
    v_stride_b, v_stride_h, v_stride_c, v_stride_d,
    idx_stride_b, idx_stride_h, idx_stride_n,
    vlen_stride_b,
    po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
    pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
    budget, split_size, scale, soft_cap, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, Q_LEN: tl.constexpr, ROW_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Partial attention of one KV group's query rows over one split of its selection.

    Query ``[batch, GROUP * num_kv_heads, Q_LEN, HEAD_DIM]``, keys/values ``[batch,
    num_kv_heads, capacity, HEAD_DIM(_V)]`` (any strides), selection ``[batch, num_kv_heads,
    budget]`` int64 (``-1`` = padding), ``valid_length`` int64 per request. Writes, per query
    row, the split's normalised output (fp32) to ``part_out`` and its log-sum-exp to
    ``part_lse`` (-inf when the split holds no allowed position).
    """
    scale = tl.cast(scale, tl.float32)
    soft_cap = tl.cast(soft_cap, tl.float32)
    pid_b, pid_s, pid_kvh, row_ok, row_t, heads = split_program(ROW_TILES, GROUP, Q_LEN, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    q = load_rows(q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d, pid_b, heads, row_t, row_ok,
                  offs_d, d_ok)
    valid_length, limit, lower = causal_limits(vlen_ptr, vlen_stride_b, pid_b, row_t, window, Q_LEN)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    idx_base = idx_ptr + pid_b * idx_stride_b + pid_kvh * idx_stride_h
    k_base = k_ptr + pid_b * k_stride_b + pid_kvh * k_stride_h
    v_base = v_ptr + pid_b * v_stride_b + pid_kvh * v_stride_h

    start = pid_s * split_size
    end = tl.minimum(start + split_size, budget)
    for n0 in range(start, end, BLOCK_N):
        pos, pos_ok = selection_block(idx_base, idx_stride_n, n0, end, valid_length, BLOCK_N)
        k = gather_rows(k_base, pos, pos_ok, offs_d, d_ok, k_stride_c, k_stride_d)
        s = dot_f32(q, tl.trans(k), DOT_IEEE, DOT_UPCAST) * scale
        p, alpha, m_i, l_i = softmax_block(s, pos, pos_ok, limit, lower, m_i, l_i, soft_cap,
                                           HAS_SOFT_CAP, HAS_WINDOW)
        v = gather_rows(v_base, pos, pos_ok, offs_dv, dv_ok, v_stride_c, v_stride_d)
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, DOT_IEEE, DOT_UPCAST)

    store_partials(acc, m_i, l_i, part_out_ptr, part_lse_ptr,
                   po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
                   pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
                   pid_b, pid_s, heads, row_t, row_ok, offs_dv, dv_ok)


@triton.jit
def sparse_mla_split_kernel(
    q_ptr, qr_ptr, k_ptr, kr_ptr, idx_ptr, vlen_ptr, part_out_ptr, part_lse_ptr,
    q_stride_b, q_stride_h, q_stride_t, q_stride_d,
    qr_stride_b, qr_stride_h, qr_stride_t, qr_stride_d,
    k_stride_b, k_stride_h, k_stride_c, k_stride_d,
    kr_stride_b, kr_stride_h, kr_stride_c, kr_stride_d,
    idx_stride_b, idx_stride_h, idx_stride_n,
    vlen_stride_b,
    po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
    pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
    budget, split_size, scale, soft_cap, window,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr, Q_LEN: tl.constexpr, ROW_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """:func:`sparse_decode_split_kernel` for multi-head latent attention: key =
    concat(latent, rope) and value = latent, so the latent tile ``[BLOCK_N, HEAD_DIM]`` is
    gathered once and serves both products. Query ``[batch, heads, Q_LEN, HEAD_DIM]`` (the
    absorbed query) and ``query_rope`` ``[batch, heads, Q_LEN, ROPE_DIM]``; latent store
    ``[batch, num_kv_heads, capacity, HEAD_DIM]`` and rope store ``[..., ROPE_DIM]``."""
    scale = tl.cast(scale, tl.float32)
    soft_cap = tl.cast(soft_cap, tl.float32)
    pid_b, pid_s, pid_kvh, row_ok, row_t, heads = split_program(ROW_TILES, GROUP, Q_LEN, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROPE_DIM
    q = load_rows(q_ptr, q_stride_b, q_stride_h, q_stride_t, q_stride_d, pid_b, heads, row_t, row_ok,
                  offs_d, d_ok)
    qr = load_rows(qr_ptr, qr_stride_b, qr_stride_h, qr_stride_t, qr_stride_d, pid_b, heads, row_t, row_ok,
                   offs_r, r_ok)
    valid_length, limit, lower = causal_limits(vlen_ptr, vlen_stride_b, pid_b, row_t, window, Q_LEN)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    idx_base = idx_ptr + pid_b * idx_stride_b + pid_kvh * idx_stride_h
    k_base = k_ptr + pid_b * k_stride_b + pid_kvh * k_stride_h
    kr_base = kr_ptr + pid_b * kr_stride_b + pid_kvh * kr_stride_h

    start = pid_s * split_size
    end = tl.minimum(start + split_size, budget)
    for n0 in range(start, end, BLOCK_N):
        pos, pos_ok = selection_block(idx_base, idx_stride_n, n0, end, valid_length, BLOCK_N)
        k = gather_rows(k_base, pos, pos_ok, offs_d, d_ok, k_stride_c, k_stride_d)
        kr = gather_rows(kr_base, pos, pos_ok, offs_r, r_ok, kr_stride_c, kr_stride_d)
        # key = concat(latent, rope): the two partial products add up.
        s = (dot_f32(q, tl.trans(k), DOT_IEEE, DOT_UPCAST)
             + dot_f32(qr, tl.trans(kr), DOT_IEEE, DOT_UPCAST)) * scale
        p, alpha, m_i, l_i = softmax_block(s, pos, pos_ok, limit, lower, m_i, l_i, soft_cap,
                                           HAS_SOFT_CAP, HAS_WINDOW)
        # the value is the latent tile already loaded as the key's first part
        acc = acc * alpha[:, None] + dot_f32(p.to(k.dtype), k, DOT_IEEE, DOT_UPCAST)

    store_partials(acc, m_i, l_i, part_out_ptr, part_lse_ptr,
                   po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
                   pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
                   pid_b, pid_s, heads, row_t, row_ok, offs_d, d_ok)


@triton.jit
def sparse_decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    po_stride_b, po_stride_h, po_stride_t, po_stride_s, po_stride_d,
    pl_stride_b, pl_stride_h, pl_stride_t, pl_stride_s,
    out_stride_b, out_stride_h, out_stride_t, out_stride_d,
    num_splits,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[b, h, t] = sum_s exp(lse_s - lse) * part_out_s in ``out``'s dtype; zeros when
    every lse_s is -inf."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V

    pl_row = part_lse_ptr + pid_b * pl_stride_b + pid_h * pl_stride_h + pid_t * pl_stride_t
    lse = tl.load(pl_row + offs_s * pl_stride_s, mask=s_ok, other=float("-inf"))
    m = max_along(lse, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_ref)
    total = sum_along(w, axis=0)
    po_row = part_out_ptr + pid_b * po_stride_b + pid_h * po_stride_h + pid_t * po_stride_t
    parts = tl.load(po_row + offs_s[:, None] * po_stride_s + offs_dv[None, :] * po_stride_d,
                    mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
    out = sum_along(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    out_row = out_ptr + pid_b * out_stride_b + pid_h * out_stride_h + pid_t * out_stride_t
    tl.store(out_row + offs_dv * out_stride_d, out.to(out_ptr.dtype.element_ty), mask=dv_ok)
