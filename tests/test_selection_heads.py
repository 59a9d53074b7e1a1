"""The selection-head protocol (``passes/heads.py``): a new head is a scorer
(``runtime/scorers.py``) and one subclass saying where its inputs are; the pass drives it with
no change and every decode site attends over what it selects."""

from __future__ import annotations

import pytest
import torch
from _tiny import compiled_steps, tiny_llama
from torch import fx

import specontext_compile as sc
from specontext_compile.backend import clear_compile_reports
from specontext_compile.passes import sparse_rewrite
from specontext_compile.passes.head_draft import DraftHead
from specontext_compile.passes.head_lagged import LaggedQueryHead
from specontext_compile.passes.heads import ScoreInputs, SelectionHead
from specontext_compile.passes.sparse_rewrite import make_head
from specontext_compile.runtime import aten_step, scorers


def recency_score(record, stores, cached, q_len, visible, variant, position_bias=None) -> torch.Tensor:
    """A scorer that ranks every position by itself: the most recent score highest
    (float32 ``[batch, num_kv_heads, capacity]``; what is not visible is left out by the
    selection shared by every head)."""
    b, kv, capacity = scorers.store_shape(stores[0])
    return torch.arange(capacity, dtype=torch.float32, device=cached.device).expand(b, kv, capacity)


def always_ready(record, stores, cached, q_len) -> torch.Tensor:
    return torch.ones((), dtype=torch.bool, device=cached.device)


class RecencyHead(SelectionHead):
    """A head that records nothing and keeps the most recent tokens (a sliding window)."""

    label = scorer = "recency"

    def prepare(self, graph, anchor, anchored, resolved):
        return None

    def unusable(self, decode):
        return None

    def score_inputs(self, graph: fx.Graph, anchor, mask, decode) -> ScoreInputs:
        site = decode[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        after = max((anchor, mask or anchor), key=order.__getitem__)
        return ScoreInputs(after, (), [site.key_cache], site.length, site.q_len, site.scale)


def test_make_head_picks_the_head_the_options_name(tmp_path):
    assert isinstance(make_head(None, None), LaggedQueryHead)
    assert isinstance(make_head((2, 4), None), LaggedQueryHead)
    head = make_head(None, str(tmp_path))
    assert isinstance(head, DraftHead) and head.label == f"draft:{tmp_path}"


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_new_head_is_one_subclass_and_every_site_attends_over_its_selection(monkeypatch, inner):
    """A recency head plugged in through the protocol: the compile report names it, every
    decode site of every step runs the gather path (the step's own counters), and each
    site attends to exactly the ``budget`` most recent tokens (the eager op chain's calls)."""
    monkeypatch.setattr(sparse_rewrite, "make_head", lambda layers, folder, keys: RecencyHead())
    monkeypatch.setitem(scorers.SCORERS, "recency", scorers.Scorer(recency_score, always_ready))
    seen = []
    real = aten_step.sparse_attention_reference

    def spy(query, key_cache, value_cache, indices, length, *rest):
        seen.append((indices.clone(), int(length)))
        return real(query, key_cache, value_cache, indices, length, *rest)

    if inner == "eager":  # the spy reads the length on the host: not inside a traced graph
        monkeypatch.setattr(aten_step, "sparse_attention_reference", spy)
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    clear_compile_reports()
    budget, steps = 8, 4
    _, cache = compiled_steps(model, ids, steps, budget=budget, page_rescue=0, dense_shortcut=False, inner=inner,
                             sink_tokens=0)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and all(r.result.selection_head == "recency" for r in decode)
    assert all(r.result.retrieval_layers == () for r in decode)  # nothing recorded
    counts = cache.path_counts()
    assert counts["decode_steps"] == steps and counts["gather_sites"] == counts["sparse_sites"] == 2 * steps
    if inner == "eager":
        assert len(seen) == 2 * steps
        for indices, length in seen:  # length counts the step's own token
            assert sorted(indices[0, 0].tolist()) == list(range(length - budget, length))
