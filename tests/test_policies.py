"""Every selection policy through the same checks (shapes, finiteness, defining property)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks import policies as P  # noqa: E402

LAYERS, HEADS, KV, D, N = 3, 4, 2, 8, 50


def make_step(seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, KV, N + 1, D, generator=gen) for _ in range(LAYERS)]
    queries = [torch.randn(1, HEADS, 1, D, generator=gen) for _ in range(LAYERS)]
    prev = [torch.randn(1, HEADS, 1, D, generator=gen) for _ in range(LAYERS)]
    acc = [torch.rand(KV, N + 1, generator=gen) for _ in range(LAYERS)]
    return P.DecodeStep(queries, keys, prev, acc, D**-0.5)


ALL = [P.LaggedQuery(layers=(0, 2)), P.StreamingLLM(), P.Quest(page_tokens=8), P.H2O(),
       P.OracleTopK(), P.RandomTokens()]


@pytest.mark.parametrize("policy", ALL, ids=lambda p: type(p).__name__)
def test_scores_shape_and_finite(policy):
    scores = policy.scores(make_step(), layer=1)
    assert scores.shape == (KV, N)
    assert torch.isfinite(scores).all()


def test_oracle_is_the_layer_attention_argmax():
    step = make_step(1)
    probs = torch.softmax((step.queries[1] @ step.keys[1][:, :, :N].repeat_interleave(2, 1).transpose(-1, -2)) * step.scale, -1)
    top = probs[0, :, 0].view(KV, 2, N).amax(1).argmax(-1)
    assert torch.equal(P.OracleTopK().scores(step, 1).argmax(-1), top)


def test_quest_bound_is_an_upper_bound_of_every_token_score():
    step = make_step(2)
    bound = P.Quest(page_tokens=8).scores(step, 0)
    exact = torch.einsum("hd,hnd->hn", step.queries[0][0, :, 0], step.keys[0][0].repeat_interleave(2, 0)[:, :N])
    assert (bound.repeat_interleave(2, 0) >= exact - 1e-5).all()


def test_lagged_query_needs_a_previous_step():
    step = make_step()
    step.previous_queries = None
    with pytest.raises(ValueError, match="previous step"):
        P.LaggedQuery().scores(step, 0)


def test_streaming_prefers_recent_tokens():
    scores = P.StreamingLLM().scores(make_step(), 0)
    assert int(scores.argmax(-1)[0]) == N - 1
