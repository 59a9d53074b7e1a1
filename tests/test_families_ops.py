"""Op-level checks of what the family matrix needs: soft-capping and sliding windows in the
sparse op, and selection inside a sliding window."""

import pytest
import torch
from benchmarks.host_selection import select_tokens, window_start
from specontext_compile.runtime.sparse_attention import sparse_attention_reference
from specontext_compile.runtime.spec import AttentionVariant


def dense_reference(q, k, v, length, scale, soft_cap=None, window=0):
    """float64 attention of ``q`` [b, h, s, d] over the first ``length`` rows of k/v
    [b, kv, cap, d] (GQA by repeat), causal, with Gemma soft-capping and HF's window."""
    _, h, s, _ = q.shape
    g = h // k.shape[1]
    k = k[:, :, :length].double().repeat_interleave(g, 1)
    v = v[:, :, :length].double().repeat_interleave(g, 1)
    logits = q.double() @ k.transpose(-1, -2) * scale
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    rows = torch.arange(s).view(s, 1) + length - s
    pos = torch.arange(length).view(1, length)
    allowed = pos <= rows
    if window:
        allowed &= pos > rows - window
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return probs @ v


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("soft_cap,window", [(None, 0), (5.0, 0), (None, 7), (2.5, 7)])
def test_sparse_op_with_soft_cap_and_window_equals_dense_at_full_selection(q_len, soft_cap, window):
    torch.manual_seed(0)
    b, h, kv, d, cap, length = 2, 6, 2, 8, 40, 27
    q = torch.randn(b, h, q_len, d) * 3  # large logits so the cap matters
    k, v = torch.randn(b, kv, cap, d), torch.randn(b, kv, cap, d)
    k[:, :, length:] = float("nan")  # unwritten slots must never be read
    indices = torch.cat([torch.randperm(length), torch.full((5,), -1)]).expand(b, kv, -1).contiguous()
    out = sparse_attention_reference(q, k, v, indices, torch.tensor(length), None, AttentionVariant(0.35, soft_cap, window))
    ref = dense_reference(q, k, v, length, 0.35, soft_cap, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_soft_cap_changes_the_result():
    """Guards the test above against a cap that is silently ignored."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1, 8) * 3, torch.randn(1, 2, 16, 8)
    idx = torch.arange(16).expand(1, 2, 16).contiguous()
    a = sparse_attention_reference(q, k, k, idx, torch.tensor(16), None, AttentionVariant(1.0))
    c = sparse_attention_reference(q, k, k, idx, torch.tensor(16), None, AttentionVariant(1.0, 1.0))
    assert (a - c).abs().max() > 1e-2


def test_selection_inside_a_sliding_window():
    scores = torch.rand(1, 2, 100, generator=torch.Generator().manual_seed(0))
    scores[..., :10] = 10.0  # tempting positions far outside the window
    sel = select_tokens(scores, length=100, q_len=1, slots=8, sink=4, window=2, sliding_window=24)
    assert window_start(100, 1, 24) == 76
    assert sel.shape == (1, 2, 8) and (sel >= 76).all() and (sel < 100).all()
    assert all(len(set(row.tolist())) == 8 for row in sel.view(-1, 8))
    assert {98, 99} <= set(sel[0, 0].tolist())  # the recent window is kept
    # budget larger than the window: padding, then exactly the window (ascending)
    sel = select_tokens(scores, length=100, q_len=2, slots=32, sink=4, window=2, sliding_window=24)
    start = window_start(100, 2, 24)
    assert start == 75
    assert sel[0, 0].tolist() == [-1] * (32 - (100 - start)) + list(range(start, 100))
    # no window: sinks are kept
    sel = select_tokens(scores, length=100, q_len=1, slots=8, sink=4, window=2)
    assert {0, 1, 2, 3} <= set(sel[0, 0].tolist())
