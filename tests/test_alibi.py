"""Attention with an additive position bias instead of rotary embeddings (ALiBi; issue 14
item 2): BLOOM's sites are rewritten with the bias gathered at the selected positions like a
mask, and the selection adds the bias to its scores."""

import pytest
import torch
from _families import DECODE_STEPS, record_caches, run_family
from specontext_compile.runtime import scorers
from specontext_compile.runtime.protocol import is_op
from specontext_compile.runtime.sparse_attention import sparse_attention_reference
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from test_backend_e2e import assert_gather_path

SPARSE = torch.ops.specontext.sparse_attention.default


def alibi(heads: int, capacity: int) -> torch.Tensor:
    """BLOOM-style bias ``slope_h * position`` ``[1, heads, 1, capacity]``, slopes 2^-1 .. 2^-heads."""
    slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)
    return (slopes.view(heads, 1) * torch.arange(capacity)).view(1, heads, 1, capacity)


def test_bloom_rewritten_and_exact_at_full_budget_on_the_gather_path(monkeypatch):
    """Both decode sites become sparse attention whose additive mask carries the ALiBi bias;
    at a budget covering the context, logits equal eager dense BLOOM (counters: gather)."""
    caches = record_caches(monkeypatch)
    r = run_family("bloom", "eager", dense_shortcut=False)
    assert (r["decode_rewritten"], r["decode_sites"]) == (2, 2), r["reasons"]
    assert r["max_err"] < 1e-4
    assert_gather_path(caches[-1], 2 * DECODE_STEPS)
    sites = [s for rep in r["reports"] for s in rep.result.sites]
    assert all(s.pattern == "alibi-bmm" and s.node.target is SPARSE for s in sites)
    select = next(n for n in sites[0].node.graph.nodes if is_op(n, scorers.head_select))
    assert select.args[-1] is not None  # the selection receives the bias


@pytest.mark.slow
def test_bloom_small_budget_inductor_equals_eager_op_chain():
    """Budget 8 of 50 tokens: the lowered step and the eager op chain give the same logits,
    and every site gathers 8 positions."""
    runs = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        r = run_family("bloom", "eager", budget=8, inner=inner)
        runs[inner] = r["compiled"]
        assert r["decode_rewritten"] == 2
    for a, b in zip(runs["eager"], runs["inductor"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_selection_accounts_for_the_position_bias():
    """A far token whose key matches the query best is selected without the bias and not
    with a steep ALiBi slope (it then scores below the recent tokens)."""
    b, h, cap, d = 1, 2, 40, 8
    keys = torch.zeros(b, 1, cap, d)
    keys[0, 0, 3] = 4.0  # the far token the query matches
    keys[0, 0, 20:30] = 0.5
    state = torch.ones(8, b, h, 1, d)
    valid = torch.full((8,), 30, dtype=torch.long)
    args = (torch.tensor(30), 1, StepSpec(4, 4, sink_tokens=0, recent_window=1), AttentionVariant(0.35))
    plain = scorers.speculative_select((state, valid), [keys], *args)
    bias = alibi(h, cap) * 8  # steep: 4 and 2 logits per position
    biased = scorers.speculative_select((state, valid), [keys], *args, position_bias=bias)
    assert 3 in plain[0, 0].tolist()
    assert 3 not in biased[0, 0].tolist()
    assert set(biased[0, 0].tolist()) <= set(range(20, 31))


@pytest.mark.parametrize("q_len", [1, 2])
def test_sparse_attention_with_a_per_head_bias_equals_float64_over_the_selection(q_len):
    """The bias enters the sparse op as a per-head additive mask ``[b, h, q, capacity]``,
    gathered at the selected positions: equal to float64 attention with the bias over
    exactly those positions."""
    torch.manual_seed(0)
    b, h, cap, d, length = 2, 4, 32, 8, 25
    q, k, v = torch.randn(b, h, q_len, d), torch.randn(b, h, cap, d), torch.randn(b, h, cap, d)
    bias = alibi(h, cap).expand(b, h, q_len, cap)
    picked = torch.tensor([0, 2, 5, 9, 13, 17, 20] + list(range(length - q_len, length)))
    indices = torch.cat([torch.full((3,), -1), picked]).expand(b, h, -1).contiguous()
    out = sparse_attention_reference(q, k, v, indices, torch.tensor(length), bias.contiguous(), AttentionVariant(0.3))
    logits = (q.double() @ k[:, :, picked].double().transpose(-1, -2)) * 0.3 + bias[..., picked].double()
    rows = torch.arange(q_len).view(q_len, 1) + length - q_len
    logits = logits.masked_fill(picked.view(1, -1) > rows, float("-inf"))
    ref = logits.softmax(-1) @ v[:, :, picked].double()
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)


def test_mpt_sites_are_counted_and_explained():
    """MPT's attention is split by a graph break (it compares ``cache.get_seq_length()``, a
    tensor for any preallocated cache, in Python): the score products are still counted as
    sites, dense with that reason, and decoding stays exact."""
    r = run_family("mpt", "eager")
    assert r["decode_sites"] == 2 and r["decode_rewritten"] == 0
    assert any("graph break inside the attention" in reason for reason in r["reasons"])
    assert r["max_err"] < 1e-4
