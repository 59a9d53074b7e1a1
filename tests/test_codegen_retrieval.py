"""Retrieval scoring kernel (SpeContext section 3.2) and top-k selection.

Properties against a float64 reference on CPU under the Triton interpreter (module fixture)
or on CUDA: softmax weights max-reduced over each KV group, -inf past each request's valid
length, cache slots past it poisoned with NaN; ``select_topk`` keeps sinks and the recent
window, never selects an invalid position and pads with -1.
"""


import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from benchmarks.attention_cases import strided_cache

from specontext_compile import codegen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks.retrieval_scorer import retrieval_scores, select_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
# Scores are softmax weights in [0, 1]. Products of fp16/bf16 inputs are exact in fp32 and the
# reference uses the same rounded inputs, so one fp32-level tolerance holds for every dtype.
RTOL, ATOL = 1e-5, 1e-6


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


@pytest.mark.parametrize("group", [1, 3, 4, 6, 7, 8])
@settings(max_examples=8, **SETTINGS)
@given(
    dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    head_dim=st.sampled_from([64, 80, 128]),
    length=st.integers(1, 70),
    short=st.integers(1, 70),
    num_kv=st.integers(1, 2),
    splits=st.integers(1, 4),
    layout=st.sampled_from(["contiguous", "token_major"]),
    scale_mul=st.sampled_from([1.0, 6.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_scores_match_reference(
    group, dtype, head_dim, length, short, num_kv, splits, layout, scale_mul, seed
):
    gen = torch.Generator().manual_seed(seed)
    tdtype = codegen.KernelSpec(dtype=dtype).torch_dtype
    capacity = length + 5
    query = torch.randn(2, num_kv * group, 1, head_dim, generator=gen).to(DEVICE, tdtype)
    keys = strided_cache(2, num_kv, capacity, head_dim, tdtype, layout, gen, DEVICE)
    vlen = torch.tensor([length, min(short, length)], device=DEVICE)
    for b in range(2):
        keys[b, :, int(vlen[b]) :] = float("nan")  # never written: must never be read
    scale = scale_mul * head_dim**-0.5
    got = retrieval_scores(
        query, keys, length, scale=scale, valid_length=vlen, num_splits=splits, block_n=16
    )
    want = codegen.reference_retrieval_scores(query, keys, length, scale=scale, valid_length=vlen)
    assert got.shape == (2, num_kv, length) and got.dtype == torch.float32
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=RTOL, atol=ATOL)


def test_scores_validate_arguments():
    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="length=9"):
        retrieval_scores(q, k, 9)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        retrieval_scores(q[:, :3], k, 4)
    with pytest.raises(ValueError, match="one token"):
        retrieval_scores(q.expand(1, 4, 2, 16), k, 4)


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 60),
    short=st.integers(1, 60),
    budget=st.integers(1, 80),
    sink=st.integers(0, 4),
    window=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_topk_properties(length, short, budget, sink, window, seed):
    sink, window = min(sink, budget), min(window, max(0, budget - min(sink, budget)))
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 3, length, generator=gen)
    vlen = torch.tensor([length, min(short, length)])
    idx = select_topk(scores, budget, sink=sink, window=window, valid_length=vlen)
    assert idx.shape == (2, 3, budget) and idx.dtype == torch.int64
    for b in range(2):
        n = int(vlen[b])
        for h in range(3):
            row = idx[b, h]
            chosen = row[row >= 0]
            assert len(set(chosen.tolist())) == len(chosen)  # unique
            assert bool((chosen < n).all())  # never past the valid length
            assert len(chosen) == min(budget, n)  # -1 only when the budget exceeds the context
            forced = set(range(min(sink, n))) | set(range(max(0, n - window), n))
            assert forced <= set(chosen.tolist())
            rest = [p for p in range(n) if p not in forced]
            picked = [p for p in chosen.tolist() if p not in forced]
            left = [p for p in rest if p not in picked]
            if picked and left:  # the free slots went to the highest scores
                assert float(scores[b, h, picked].min()) >= float(scores[b, h, left].max())


def test_select_topk_rejects_overfull_forced_set():
    with pytest.raises(ValueError, match="sink \\+ window = 9 exceeds budget=8"):
        select_topk(torch.rand(1, 1, 20), 8, sink=4, window=5)


def test_scores_then_topk_pick_the_attended_tokens():
    """End to end: the tokens that one query attends to most come out of top-k."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 1, 50, 32, generator=gen)
    query = torch.zeros(1, 2, 1, 32)
    query[0, 0, 0] = 8 * keys[0, 0, 11] / keys[0, 0, 11].norm()  # head 0 likes token 11
    query[0, 1, 0] = 8 * keys[0, 0, 37] / keys[0, 0, 37].norm()  # head 1 likes token 37
    scores = retrieval_scores(query.to(DEVICE), keys.to(DEVICE), 50, scale=1.0)
    idx = select_topk(scores, 4, sink=1, window=1)
    assert {0, 49, 11, 37} == set(idx[0, 0].tolist())
