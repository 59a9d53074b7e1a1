"""Numerics of every query-key product, and the recall probe's attention.

1. Half precision: a raw ``q . k`` above float16's 65504 whose *scaled* logit is small must
   not overflow (field case ``fp16_logit_overflow``). Checked on every path that forms such a
   product: the torch attention path (``attend_gathered``: resident, offloaded, the op),
   retrieval scoring (``group_max_softmax``, draft-head scores), the codegen float64
   oracles, and the generated Triton kernels (run under ``TRITON_INTERPRET=1`` on CPU).
   References are float64 attention of the same (already rounded) inputs, written here.
2. The recall probe must measure the attention the layer computes: soft cap and sliding
   window included (field case ``softcap_recall``), as must the fidelity benchmark's recall.

Error model for the float16 torch path (stated tolerance, ``u = 2**-11``): the query is
rounded once after scaling and the logit once after a float32 accumulation, so logit ``j``
is off by ``|d_j| <= 2.5 u A_j`` with ``A_j = scale * sum_i |q_i| |k_ji|`` (2 roundings, plus
``D * 2**-24`` for the accumulation). To first order the output moves by
``sum_j p_j (d_j - sum_i p_i d_i) (v_j - out)`` (p: the float64 weights), bounded by
``S = sum_j p_j (|d_j| + sum_i p_i |d_i|) |v_j - out|``: a key that dominates the softmax
costs nothing however large its logit error. Rounding the weights to float16 before
``p @ v`` and the output adds ``u (|ref| + max|v|)``. Tolerance: ``2 S + 2u (|ref| + max|v|)``
(a factor 2 for second-order terms). On an overflowing product the old path zeroed the row,
an error of ``|ref|``, far above this tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specontext_compile.recall import RecallProbe, selection_recall
from specontext_compile.runtime.retrieval import group_max_softmax
from specontext_compile.runtime.sparse_attention import (
    attend_gathered,
    query_key_logits,
    sparse_attention_reference,
)

import specontext_compile  # noqa: F401  (registers the specontext:: ops)
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

FP16_MAX = 65504.0
U16 = 2.0**-11
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


# ------------------------------------------------------------------------------------------
# float64 references (own code, loops over rows: no shared code with the project)
# ------------------------------------------------------------------------------------------
def _row_logits64(q_row, keys, scale, soft_cap):
    s = (keys.double() @ q_row.double()) * scale
    return s if soft_cap is None else torch.tanh(s / soft_cap) * soft_cap


def attention64(q, k, v, idx, length, scale, soft_cap=None, window=0, mask_add=None):
    """float64 attention of q [B,H,Q,D] over the positions idx [B,KV,S] (-1 = none); row r
    sees p <= length-Q+r (and p > that - window when window > 0).

    Returns ``(out, sens)``: ``sens`` [B,H,Q,Dv] is the error model's first-order output
    sensitivity ``sum_j p_j (A_j + sum_i p_i A_i) |v_j - out|`` for logit errors ``A_j``
    (multiply by ``2.5 u`` for the float16 bound)."""
    B, H, Q, _ = q.shape
    KV = k.shape[1]
    g = H // KV
    out = torch.zeros(B, H, Q, v.shape[-1], dtype=torch.float64)
    sens = torch.zeros_like(out)
    for b in range(B):
        for h in range(H):
            pos_all = [int(p) for p in idx[b, h // g] if int(p) >= 0]
            for r in range(Q):
                lim = length - Q + r
                ps = [p for p in pos_all if p <= lim and (window <= 0 or p > lim - window)]
                if not ps:
                    continue
                K, V = k[b, h // g, ps].double(), v[b, h // g, ps].double()
                s = _row_logits64(q[b, h, r], K, scale, soft_cap)
                if mask_add is not None:
                    s = s + mask_add[b, 0, r, ps].double()
                p = torch.softmax(s, 0)
                out[b, h, r] = p @ V
                a = (K.abs() @ q[b, h, r].double().abs()) * scale  # A_j
                sens[b, h, r] = (p * (a + p @ a)) @ (V - out[b, h, r]).abs()
    return out, sens


def raw_max(q, k) -> float:
    """max |q . k| (unscaled, exact) over every query head and key of its KV group."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    return float((q.double() @ k.transpose(-1, -2)).abs().max())


def fp16_tolerance(ref: torch.Tensor, v: torch.Tensor, sens: torch.Tensor) -> torch.Tensor:
    vmax = float(v.double().abs().max())
    return 2 * 2.5 * U16 * sens + 2 * U16 * (ref.abs() + vmax)


def aligned_fp16(seed, B, H, KV, D, C, magnitude, aligned_positions):
    """fp16 q, k, v with keys at ``aligned_positions`` aligned with the queries, so their raw
    q . k is about D * magnitude**2 (above 65504 for magnitude >= 23 at D=128)."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randn(D, generator=gen).sign()
    q = (sign * magnitude + torch.randn(B, H, 1, D, generator=gen)).half()
    k = (torch.randn(B, KV, C, D, generator=gen) * 2).half()
    for j, p in enumerate(aligned_positions):
        k[:, :, p] = (sign * (magnitude - 0.5 * j)).half()
    v = torch.randn(B, KV, C, D, generator=gen).half()
    return q, k, v


# ------------------------------------------------------------------------------------------
# 1. float16 products
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_query_key_logits_wide_dtypes_within_1e6_of_product_then_scale(dtype):
    """Scaling the query first changes float32/float64 logits by rounding only."""
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(2, 3, 4, 32, generator=gen) * 3).to(dtype)
    k = (torch.randn(2, 3, 17, 32, generator=gen) * 3).to(dtype)
    scale = 32**-0.5
    got = query_key_logits(q, k, scale)
    assert got.dtype == torch.float32
    ref = (q.double() @ k.double().transpose(-1, -2)) * scale
    a = (q.double().abs() @ k.double().abs().transpose(-1, -2)) * scale  # A_j
    old = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    # float32 rounding of a 32-term dot product: well under 1e-6 relative to A_j, as before
    for logits in (got, old):
        assert ((logits.double() - ref).abs() <= 1e-6 * (a + 1)).all()


def test_sparse_attention_float32_unchanged_within_1e6():
    """float32 inputs: the op's output stays within 1e-6 of float64 attention (and so of the
    product-then-scale formula it replaced)."""
    gen = torch.Generator().manual_seed(9)
    B, H, KV, D, C, length = 2, 4, 2, 64, 30, 28
    q = torch.randn(B, H, 2, D, generator=gen)
    k = torch.randn(B, KV, C, D, generator=gen)
    v = torch.randn(B, KV, C, D, generator=gen)
    idx = torch.stack([torch.randperm(length, generator=gen)[:12] for _ in range(B * KV)]).view(B, KV, 12)
    scale = D**-0.5
    out = torch.ops.specontext.sparse_attention(q, k, v, idx, torch.tensor(length), None, StepSpec(12, 12),
                                                AttentionVariant(scale))
    ref, _ = attention64(q, k, v, idx, length, scale)
    assert float((out.double() - ref).abs().max()) < 1e-6


def test_query_key_logits_fp16_product_above_range():
    q, k, _ = aligned_fp16(1, 1, 2, 1, 128, 12, 26.0, [4])
    assert raw_max(q, k) > FP16_MAX  # the naive fp16 product would be inf
    scale = 128**-0.5
    got = query_key_logits(q, k, scale)
    ref = (q.double() @ k.double().transpose(-1, -2)) * scale
    a = (q.double().abs() @ k.double().abs().transpose(-1, -2)) * scale  # A_j per entry
    assert torch.isfinite(got).all()
    assert ((got.double() - ref).abs() <= 2.5 * U16 * a).all()


@pytest.mark.parametrize("q_len,window", [(1, 0), (2, 0), (1, 6)])
def test_sparse_attention_fp16_product_above_range(q_len, window):
    """Own inputs (GQA group 3, head_dim 128, several strongly aligned keys): the op's torch
    path, the reference and the gather path match float64 attention within the fp16 bound."""
    B, H, KV, D, C, length = 2, 6, 2, 128, 40, 33
    q, k, v = aligned_fp16(11, B, H, KV, D, C, 25.0, [3, 20, length - 1])
    q = q.expand(B, H, q_len, D).contiguous()
    scale = D**-0.5
    idx = torch.tensor([0, 1, 3, 7, 20, 25, 29, 30, 31, length - 1, -1])
    idx = idx.expand(B, KV, -1).contiguous()
    assert raw_max(q, k) > FP16_MAX
    ref, sens = attention64(q, k, v, idx, length, scale, window=window)
    tol = fp16_tolerance(ref, v, sens)
    for out in (
        torch.ops.specontext.sparse_attention(q, k, v, idx, torch.tensor(length), None, StepSpec(1, 1),
                                              AttentionVariant(scale, sliding_window=window)),
        sparse_attention_reference(q, k, v, idx, torch.tensor(length), None, AttentionVariant(scale, sliding_window=window)),
    ):
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert ((out.double() - ref).abs() <= tol).all(), float((out.double() - ref).abs().max())


def test_attend_gathered_fp16_soft_cap_and_mask():
    """The offload tier's entry (keys already gathered) with a soft cap and a padding mask."""
    B, H, KV, D, C, length = 1, 4, 1, 128, 24, 24
    q, k, v = aligned_fp16(5, B, H, KV, D, C, 24.0, [2, 9])
    scale, cap = D**-0.5, 30.0
    idx = torch.arange(C).view(1, 1, C)
    mask = torch.zeros(B, 1, 1, C)
    mask[..., :2] = float("-inf")  # left padding
    out = attend_gathered(q, k, v, idx, torch.tensor(length), mask, AttentionVariant(scale, cap))
    ref, sens = attention64(q, k, v, idx, length, scale, soft_cap=cap, mask_add=mask)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).abs() <= fp16_tolerance(ref, v, sens)).all()


@settings(max_examples=40, **SETTINGS)
@given(
    exponent=st.floats(-2.0, 7.0),
    logit_std=st.floats(0.25, 4.0),
    head_dim=st.sampled_from([16, 64, 128]),
    group=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    seed=st.integers(0, 2**31 - 1),
)
def test_fp16_attention_of_random_magnitude_matches_float64(exponent, logit_std, head_dim, group,
                                                            budget, seed):
    """fp16 q, k with entries of magnitude m = 2**exponent (raw products up to ~1e5, above
    fp16's range for large m) and a scale that puts the logits at std ``logit_std``: the
    output is finite and within the stated fp16 tolerance of float64 attention."""
    gen = torch.Generator().manual_seed(seed)
    m = 2.0**exponent
    B, KV, C, length = 1, 2, 32, 30
    H = KV * group
    q = (torch.randn(B, H, 1, head_dim, generator=gen) * m).half()
    k = (torch.randn(B, KV, C, head_dim, generator=gen) * m).half()
    v = torch.randn(B, KV, C, head_dim, generator=gen).half()
    scale = logit_std / (m * m * math.sqrt(head_dim))
    idx = torch.stack([torch.randperm(length, generator=gen)[:budget] for _ in range(KV)])[None]
    out = sparse_attention_reference(q, k, v, idx, torch.tensor(length), None, AttentionVariant(scale))
    ref, sens = attention64(q, k, v, idx, length, scale)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    assert (err <= fp16_tolerance(ref, v, sens)).all(), float(err.max())


def test_group_max_softmax_fp16_product_above_range():
    from specontext_compile.runtime.scorers import draft_score
    from specontext_compile.runtime.spec import AttentionVariant

    B, H, KV, D, C = 1, 4, 2, 128, 20
    q, k, _ = aligned_fp16(7, B, H, KV, D, C, 26.0, [6, 13])
    assert raw_max(q, k) > FP16_MAX
    scale = D**-0.5
    g = H // KV
    kk = k.double().repeat_interleave(g, 1)
    p = torch.softmax(torch.einsum("bhd,bhnd->bhn", q[:, :, 0].double(), kk) * scale, -1)
    ref = p.view(B, KV, g, C).amax(2)
    a = torch.einsum("bhd,bhnd->bhn", q[:, :, 0].double().abs(), kk.abs()) * scale  # A_j
    # first order: |dp_j| <= p_j (|d_j| + sum_i p_i |d_i|), |d_j| <= 2.5 u A_j; the group max
    # moves by at most the largest |dp_j| of the group; factor 2 for second-order terms
    dp = p * (a + (p * a).sum(-1, keepdim=True)) * 2.5 * U16
    tol = 2 * dp.view(B, KV, g, C).amax(2) + 1e-7
    # the draft head's scorer over all C positions (layer 0's store shape: batch, KV heads, C)
    draft = draft_score((q, k, torch.tensor(C)), [k], torch.tensor(C), 0, None, AttentionVariant(scale))
    for got in (group_max_softmax(q, k, scale), draft):
        assert torch.isfinite(got).all()
        assert ((got.double() - ref).abs() <= tol).all(), float((got.double() - ref).abs().max())


def test_codegen_reference_scales_query_first():
    """The kernels' oracle agrees with float64 attention on products above fp16's range, and
    a float32 compute dtype stays within 1e-6 of float64."""
    from specontext_compile.codegen import reference_sparse_decode_attention

    B, H, KV, D, C, length = 1, 4, 2, 128, 30, 30
    q, k, v = aligned_fp16(13, B, H, KV, D, C, 25.0, [4, 17])
    idx = torch.tensor([0, 4, 9, 17, 28, 29]).expand(B, KV, -1).contiguous()
    scale = D**-0.5
    ref, _ = attention64(q, k, v, idx, length, scale)
    got64 = reference_sparse_decode_attention(q, k, v, idx, length, scale=scale)
    got32 = reference_sparse_decode_attention(q, k, v, idx, length, scale=scale,
                                              compute_dtype=torch.float32)
    assert float((got64 - ref).abs().max()) < 1e-12
    assert float((got32.double() - ref).abs().max()) < 1e-6


# ---- generated Triton kernels (interpreter on CPU) --------------------------------------
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("soft_cap,window", [(None, None), (40.0, 9)])
def test_triton_kernel_fp16_product_above_range(soft_cap, window):
    """``tl.dot`` of fp16 tiles returns float32 and ``scale`` is applied after it: no overflow;
    error within the kernel's stated fp16 bound (codegen/accuracy.py)."""
    from specontext_compile.codegen import sparse_decode_attention
    from specontext_compile.codegen.accuracy import assert_within_bound

    B, H, KV, D, C, length = 1, 4, 2, 128, 40, 36
    q, k, v = aligned_fp16(17, B, H, KV, D, C, 26.0, [5, 30])
    assert raw_max(q, k) > FP16_MAX
    idx = torch.tensor([0, 1, 5, 12, 30, 31, 33, 34, 35]).expand(B, KV, -1).contiguous()
    scale = D**-0.5
    out = sparse_decode_attention(q, k, v, idx, torch.tensor(length), scale=scale,
                                  soft_cap=soft_cap, sliding_window=window)
    ref, _ = attention64(q, k, v, idx, length, scale, soft_cap=soft_cap, window=window or 0)
    vmax = float(v.double()[:, :, idx[0, 0]].abs().max())
    assert_within_bound(out, ref, vmax, "fp16", "fp16 products above 65504")


@pytest.mark.usefixtures("triton_interpreter")
def test_triton_mla_kernel_fp16_product_above_range():
    """MLA layout: latent and RoPE partial products add up in float32 before the scale."""
    from specontext_compile.codegen import sparse_mla_decode_attention
    from specontext_compile.codegen.accuracy import assert_within_bound

    B, H, KV, D, R, C, length = 1, 4, 1, 64, 16, 24, 24
    q, latent, _ = aligned_fp16(19, B, H, KV, D, C, 34.0, [3, 11])
    gen = torch.Generator().manual_seed(2)
    qr = (torch.randn(B, H, 1, R, generator=gen) * 4).half()
    rope = (torch.randn(B, KV, C, R, generator=gen) * 4).half()
    assert raw_max(q, latent) > FP16_MAX
    idx = torch.tensor([0, 3, 7, 11, 20, 23]).view(1, 1, -1)
    scale = (D + R) ** -0.5
    out = sparse_mla_decode_attention(q, qr, latent, rope, idx, torch.tensor(length), scale=scale)
    ref, _ = attention64(torch.cat([q, qr], -1), torch.cat([latent, rope], -1), latent, idx, length,
                         scale)
    vmax = float(latent.double()[:, :, idx[0, 0]].abs().max())
    assert_within_bound(out, ref, vmax, "fp16", "MLA fp16 products above 65504")


# ------------------------------------------------------------------------------------------
# 2. recall of the attention the layer computes
# ------------------------------------------------------------------------------------------
def recall64(q, k, idx, length, scale, soft_cap=None, window=0, mask_add=None):
    """Mean over batch, query heads and rows of the float64 dense attention mass (capped,
    windowed, masked as the layer computes it) that falls on the selected positions."""
    B, H, Q, _ = q.shape
    g = H // k.shape[1]
    vals = []
    for b in range(B):
        for h in range(H):
            sel = {int(p) for p in idx[b, h // g] if int(p) >= 0}
            for r in range(Q):
                lim = length - Q + r
                ps = [p for p in range(length) if p <= lim and (window <= 0 or p > lim - window)]
                s = _row_logits64(q[b, h, r], k[b, h // g, ps], scale, soft_cap)
                if mask_add is not None:
                    s = s + mask_add[b, 0, r, ps].double()
                w = torch.softmax(s, 0)
                vals.append(float(sum(w[i] for i, p in enumerate(ps) if p in sel)))
    return sum(vals) / len(vals)


@settings(max_examples=30, **SETTINGS)
@given(
    soft_cap=st.sampled_from([None, 5.0, 20.0, 50.0]),
    window=st.sampled_from([0, 1, 4, 9, 40]),
    q_len=st.sampled_from([1, 1, 2, 3]),
    logit_size=st.floats(1.0, 80.0),
    budget=st.integers(1, 20),
    padded=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_probe_recall_is_float64_recall_of_the_layer_attention(soft_cap, window, q_len, logit_size,
                                                               budget, padded, seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, KV, D, C, length = 2, 4, 2, 16, 32, 25
    q = torch.randn(B, H, q_len, D, generator=gen)
    k = torch.randn(B, KV, C, D, generator=gen) * logit_size / 4
    scale = D**-0.5
    idx = torch.stack([torch.stack([torch.randperm(length, generator=gen)[:budget]
                                    for _ in range(KV)]) for _ in range(B)])
    idx[:, :, 0] = -1  # a padding slot
    mask = None
    if padded:  # row 1 left-padded by 2 tokens (additive HF mask, causal part 0 elsewhere)
        mask = torch.zeros(B, 1, q_len, C)
        mask[1, :, :, :2] = float("-inf")
        if window and window <= 2:
            mask = None  # would hide every position of a row
    got = selection_recall(q, k, idx, length, scale, mask, soft_cap, window)
    want = recall64(q, k, idx, length, scale, soft_cap, window, mask)
    assert abs(got - want) < 1e-9


def test_probe_through_the_op_with_soft_cap_and_sliding_window():
    """The probe reads the op node's soft cap and window (from its ``variant`` argument, as
    an interpreter runs a one-node graph); without them the recall differs (so this input
    tells the two apart)."""
    torch.manual_seed(4)
    B, H, KV, D, C, length = 1, 4, 2, 16, 48, 40
    q = torch.zeros(B, H, 1, D)
    q[..., 0] = D**0.5  # logit = k[..., 0]
    k = torch.zeros(B, KV, C, D)
    k[..., 0] = 60.0 + torch.randn(B, KV, C)  # in the range where a cap of 50 acts
    heavy = torch.tensor([3, 5, 8, 30, 34])  # 5 and 8 unselected, outside the window
    k[:, :, heavy, 0] = 80.0
    v = torch.randn(B, KV, C, D)
    idx = torch.tensor([3, 30, 34, 38, length - 1]).expand(B, KV, -1).contiguous()
    scale, cap, window = D**-0.5, 50.0, 24
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(name) for name in ("query", "keys", "values", "indices", "length")]
    graph.output(graph.call_function(torch.ops.specontext.sparse_attention.default,
                                     (*inputs, None, StepSpec(1, 1), AttentionVariant(scale, cap, window))))
    probe = RecallProbe()
    step = probe.runner(torch.fx.GraphModule(torch.nn.Module(), graph))
    with probe.recording() as rec:
        step(q, k, v, idx, torch.tensor(length))
    assert len(rec.values) == 1
    want = recall64(q, k, idx, length, scale, cap, window)
    assert abs(rec.mean() - want) < 1e-9
    assert abs(rec.mean() - recall64(q, k, idx, length, scale)) > 0.05
    assert abs(rec.mean() - recall64(q, k, idx, length, scale, cap)) > 0.05


def test_fidelity_benchmark_recall_uses_soft_cap_and_window():
    fidelity = pytest.importorskip("benchmarks.fidelity")
    gen = torch.Generator().manual_seed(8)
    H, KV, D, n = 4, 2, 16, 30
    q = torch.randn(1, H, 1, D, generator=gen) * 3
    k = torch.randn(1, KV, n, D, generator=gen) * 3
    scale, cap, window = D**-0.5, 5.0, 8
    probs = fidelity.layer_probs(q, k, scale, cap, window)
    for h in range(H):
        ps = list(range(n - window, n))
        w = torch.softmax(_row_logits64(q[0, h, 0], k[0, h // 2, ps], scale, cap), 0)
        assert torch.allclose(probs[h, ps], w, atol=1e-12)
        assert float(probs[h, : n - window].abs().max()) == 0.0
    # H2O's prompt accumulation: same capped, windowed attention of the prompt rows
    context, rows = n, 3
    pq = torch.randn(1, H, rows, D, generator=gen) * 3
    acc = fidelity.prompt_accumulation({0: pq}, {0: k}, context, scale, [(cap, window)])[0]
    want = torch.zeros(KV, n, dtype=torch.float64)
    for kv in range(KV):
        per_head = []
        for h in range(kv * 2, kv * 2 + 2):
            tot = torch.zeros(n, dtype=torch.float64)
            for r in range(rows):
                row = context - rows + r
                ps = [p for p in range(n) if row - window < p <= row]
                tot[ps] += torch.softmax(_row_logits64(pq[0, h, r], k[0, kv, ps], scale, cap), 0)
            per_head.append(tot)
        want[kv] = torch.stack(per_head).amax(0)
    assert torch.allclose(acc, want, atol=1e-12)
