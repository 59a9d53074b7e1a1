"""Policies inside the model's attention (benchmarks/fidelity_decode.py): the harness is exact
when nothing is dropped, attends to exactly the selected tokens, and can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _tiny import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks import fidelity_decode as FD  # noqa: E402
from benchmarks import policies as P  # noqa: E402
from benchmarks.host_selection import select_tokens  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_fidelity_decode")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

CONTEXT, STEPS = 48, 12

# the tiny Llama has 3 layers: the lagged query reads layers 1 and 2
TINY_POLICIES = {
    "lagged": P.LaggedQuery(layers=(1, 2)),
    "streaming": P.StreamingLLM(),
    "quest": P.Quest(page_tokens=8),
    "h2o": P.H2O(),
    "oracle": P.OracleTopK(),
    "random": P.RandomTokens(),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3, heads=6, kv_heads=2)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (1, CONTEXT + STEPS + 1), generator=torch.Generator().manual_seed(1))


def test_budget_covering_everything_matches_dense(model, ids):
    """Budget >= every cached token: each policy keeps all tokens, so agreement is 1 and the
    NLL equals the dense run's."""
    res = FD.sweep(model, ids, CONTEXT, STEPS, [CONTEXT + STEPS], TINY_POLICIES, sink=4, window=8, h2o_queries=16)
    assert set(res["policies"]) == set(TINY_POLICIES)
    for name, per in res["policies"].items():
        row = per[CONTEXT + STEPS]
        assert row["agreement"] == 1.0, name
        assert abs(row["nll_delta"]) < 1e-5, name
        assert row["recall"] == pytest.approx(1.0, abs=1e-6), name


def test_dense_run_matches_the_model_without_the_harness(model, ids):
    """The dense run through the harness's attention gives the model's own (sdpa) NLLs."""
    pre = FD.prefill(model, ids, CONTEXT, h2o_queries=16)
    dense = FD.run_policy(model, ids, pre, CONTEXT, STEPS, None, [None])
    with torch.no_grad():
        logits = model(ids[:, : CONTEXT + STEPS]).logits[0, CONTEXT:].double()
    nll = -torch.log_softmax(logits, -1)[torch.arange(STEPS), ids[0, CONTEXT + 1 :]]
    torch.testing.assert_close(dense.nll[0], nll, atol=1e-4, rtol=0)
    assert torch.equal(dense.argmax[0], logits.argmax(-1))


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_attention_is_dense_attention_over_the_selected_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, kv, n, d, budget = 2, 6, 2, 40, 16, 12
    q = torch.randn(b, h, 1, d, generator=gen)
    k = torch.randn(b, kv, n, d, generator=gen)
    v = torch.randn(b, kv, n, d, generator=gen)
    scores = torch.rand(b, kv, n - 1, generator=gen)
    sel = select_tokens(scores, n, 1, budget, 2, 3)  # [b, kv, budget]
    mask = torch.stack([FD.selection_mask(sel[r], n) for r in range(b)])
    assert mask.sum(-1).eq(budget).all()
    out, probs, full = FD.masked_attention(q, k, v, mask, d**-0.5)
    g = h // kv
    for r in range(b):
        for head in range(h):
            idx = sel[r, head // g]
            logits = (k[r, head // g, idx].double() @ q[r, head, 0].double()) * d**-0.5
            ref = torch.softmax(logits, -1) @ v[r, head // g, idx].double()
            torch.testing.assert_close(out[r, 0, head].double(), ref, atol=1e-5, rtol=1e-5)
            outside = torch.ones(n, dtype=torch.bool)
            outside[idx] = False
            assert probs[r, head, outside].abs().max() == 0
    # the dense softmax (for recall) is the unmasked one
    dense, _, _ = FD.masked_attention(q, k, v, None, d**-0.5)
    ref = torch.softmax(q.double().view(b, kv, g, d) @ k.double().transpose(-1, -2) * d**-0.5, -1)
    torch.testing.assert_close(full.double(), ref.view(b, h, n), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dense.double().view(b, kv, g, d), ref @ v.double(), atol=1e-5, rtol=1e-5)


def test_selection_mask_drops_padding():
    sel = torch.tensor([[0, 3, -1], [1, 2, 4]])
    mask = FD.selection_mask(sel, 5)
    assert mask.tolist() == [[True, False, False, True, False], [False, True, True, False, True]]


def test_sinks_only_is_detected(model, ids):
    """Keeping only 4 sinks and the current token changes the NLL and the greedy tokens: the
    harness can fail a policy."""
    res = FD.sweep(model, ids, CONTEXT, STEPS, [5], {"sinks only": P.StreamingLLM()}, sink=4, window=0,
                   h2o_queries=16)
    row = res["policies"]["sinks only"][5]
    assert abs(row["nll_delta"]) > 1e-3
    assert row["agreement"] < 1.0
    assert row["recall"] < 0.5


def test_lagged_query_uses_the_policy_runs_own_queries(model, ids):
    """Step 0's lagged query is the prefill's last query row; later ones come from the policy
    run (not the dense run), so a sparse lagged run differs from one fed dense queries."""
    pre = FD.prefill(model, ids, CONTEXT, h2o_queries=16)
    assert pre.last_queries[1].shape == (1, 6, 1, 16)
    seen = []
    policy = P.LaggedQuery(layers=(1,))
    original = policy.scores

    class Spy:
        shared = True

        def scores(self, step, layer):
            seen.append(step.previous_queries[1].clone())
            return original(step, layer)

    FD.run_policy(model, ids, pre, CONTEXT, 3, Spy(), [8], sink=2, window=2)
    assert len(seen) == 3
    torch.testing.assert_close(seen[0], pre.last_queries[1])
    # the dense run's query of step 0 at layer 1 (dense step 0 by hand)
    dense_q = {}

    def spy_dense(module, q, k, v, mask, **kw):
        if q.shape[2] == 1:
            dense_q.setdefault(module.layer_idx, q.clone())
        return FD.sdpa_attention_forward(module, q, k, v, mask, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register("spy_dense", spy_dense)
    model.set_attn_implementation("spy_dense")
    try:
        cache = FD._run_cache(pre.cache, 1, CONTEXT + 1)
        with torch.no_grad():
            model(ids[:, CONTEXT : CONTEXT + 1], cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    # step 1 of the sparse run saw the sparse run's step-0 query of layer 1, which differs
    # from the dense run's (layer 0 attended to only 8 tokens)
    assert not torch.allclose(seen[1], dense_q[1], atol=1e-4)


def test_h2o_accumulates_what_the_policy_run_attended(model, ids):
    pre = FD.prefill(model, ids, CONTEXT, h2o_queries=16)
    cache = FD._run_cache(pre.cache, 1, CONTEXT + 2)
    run = FD._Run(P.H2O(), [6], pre, cache, CONTEXT + 2, 2, 2, model.model.layers[0].self_attn.scaling)
    from transformers import AttentionInterface

    AttentionInterface.register("h2o_probe", run.attention)
    model.set_attn_implementation("h2o_probe")
    before = {l: a.clone() for l, a in run.acc.items()}
    try:
        with torch.no_grad():
            model(ids[:, CONTEXT : CONTEXT + 1], cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    for l, a in run.acc.items():
        added = a - before[l]
        # exactly 6 tokens per KV head received attention, and each KV head got mass <= group size
        assert ((added[0] > 0).sum(-1) == 6).all(), l
        assert (added[0, :, CONTEXT + 1 :] == 0).all()


@pytest.mark.slow
def test_sinks_only_is_worse_on_real_text(smollm2):
    """On SmolLM2-135M and real text, attending to 4 sinks + the current token raises the NLL
    and breaks greedy agreement; the full-budget run equals dense."""
    import pydoc_data.topics

    model, tok = smollm2
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:3])
    ids = tok(text, return_tensors="pt").input_ids[:, :150]
    res = FD.sweep(model, ids, 128, 12, [5, 140], {"streaming": P.StreamingLLM()}, sink=4, window=0)
    sinks, full = res["policies"]["streaming"][5], res["policies"]["streaming"][140]
    assert sinks["nll_delta"] > 0.1
    assert sinks["agreement"] < 0.9
    assert full["agreement"] == 1.0 and abs(full["nll_delta"]) < 1e-5


def test_plots_are_written(model, ids, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.fidelity import plot_decode

    res = FD.sweep(model, ids, CONTEXT, 4, [8, 16], {"streaming": P.StreamingLLM()}, sink=2, window=2,
                   h2o_queries=16)
    paths = plot_decode(res, 2048, tmp_path)
    assert [p.name for p in paths] == ["fidelity_agreement_2k.png", "fidelity_nll_2k.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_sweep_resumes_and_reports_each_policy(model, ids):
    first = FD.sweep(model, ids, CONTEXT, 4, [8], {"streaming": P.StreamingLLM()}, sink=2, window=2,
                     h2o_queries=16)
    partial = []
    both = {"streaming": P.StreamingLLM(), "oracle": P.OracleTopK()}
    second = FD.sweep(model, ids, CONTEXT, 4, [8], both, sink=2, window=2, h2o_queries=16, done=first,
                      on_policy=lambda part: partial.append(list(part["policies"])))
    assert second["policies"]["streaming"] == first["policies"]["streaming"]
    assert partial == [["streaming", "oracle"]]  # only the oracle ran


def _tiny_head(tmp_path, model, variant):
    from test_draft_head_backend import write_head

    from specontext_compile.runtime.eagle3 import load_eagle3_head

    folder = write_head(tmp_path / variant, model, variant=variant, aux=(0, 1, 2))
    head, _ = load_eagle3_head(folder, target_embedding=model.model.embed_tokens.weight.detach())
    return P.DraftHead(head, fused=variant == "fused")


@pytest.mark.parametrize("variant", ["fused", "embedding"])
def test_draft_heads_run_inside_attention(model, ids, tmp_path, variant):
    """A draft head as a policy: exact when the budget covers everything, and its first
    decode step scores equal the recall harness's DraftHead scores (whole-sequence head
    forward) on the same dense prompt."""
    policy = _tiny_head(tmp_path, model, variant)
    res = FD.sweep(model, ids, CONTEXT, STEPS, [CONTEXT + STEPS, 16], {"draft": policy}, sink=2, window=4)
    full = res["policies"]["draft"][CONTEXT + STEPS]
    assert full["agreement"] == 1.0 and abs(full["nll_delta"]) < 1e-5
    assert 0.0 < res["policies"]["draft"][16]["recall"] < 1.0
    pre = FD.prefill(model, ids, CONTEXT, 16, policy.head.aux_layer_ids)
    keys = FD._DraftKeys(policy, pre, ids, CONTEXT, rows=1)
    got = keys.scores(0, ids[:, CONTEXT : CONTEXT + 1], CONTEXT)
    aux = torch.cat([pre.aux, pre.aux[:, -1:]], 1)  # the step token's own states are unused
    shifted = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)
    step = P.DecodeStep(queries=[], keys=[torch.zeros(1, 2, CONTEXT + 1, 1)], previous_queries=None,
                        accumulated=None, scale=1.0, input_ids=ids[:, : CONTEXT + 1], aux_hidden=shifted)
    torch.testing.assert_close(got, policy.scores(step, 0), atol=1e-5, rtol=1e-4)
    assert keys.keys[0].shape[2] == CONTEXT + 1  # this step's key appended
