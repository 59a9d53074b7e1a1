"""The selection-head protocol (``passes/heads.py``): a new head is one subclass; the pass
drives it with no change and every decode site attends over what it selects."""

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
from specontext_compile.passes.heads import SelectionHead
from specontext_compile.passes.sparse_rewrite import make_head
from specontext_compile.runtime import aten_step
from specontext_compile.runtime.spec import StepSpec


def recent_selection(key_cache: torch.Tensor, length: torch.Tensor, q_len: int, spec: StepSpec) -> torch.Tensor:
    """The ``spec.candidate_slots`` most recent positions of every row (int64 ``[batch,
    num_kv_heads, slots]``), through the selection code every head shares."""
    b, kv, capacity, _ = key_cache.shape
    scores = torch.arange(capacity, dtype=torch.float32, device=key_cache.device).expand(b, kv, capacity)
    return aten_step.select_positions(scores, length, q_len, min(spec.candidate_slots, capacity), 0, 0)


class RecencyHead(SelectionHead):
    """A head that records nothing and keeps the most recent tokens (a sliding window)."""

    label = "recency"

    def prepare(self, graph, anchor, anchored, resolved):
        return None

    def unusable(self, decode):
        return None

    def select(self, graph: fx.Graph, anchor, spec, window, mask, decode):
        site = decode[0]
        with graph.inserting_after(anchor):
            return graph.call_function(recent_selection, (site.key_cache, site.length, site.q_len, spec))


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
    monkeypatch.setattr(sparse_rewrite, "make_head", lambda layers, folder: RecencyHead())
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
    _, cache = compiled_steps(model, ids, steps, budget=budget, page_rescue=0, dense_shortcut=False, inner=inner)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and all(r.result.selection_head == "recency" for r in decode)
    assert all(r.result.retrieval_layers == () for r in decode)  # nothing recorded
    counts = cache.path_counts()
    assert counts["decode_steps"] == steps and counts["gather_sites"] == counts["sparse_sites"] == 2 * steps
    if inner == "eager":
        assert len(seen) == 2 * steps
        for indices, length in seen:  # length counts the step's own token
            assert sorted(indices[0, 0].tolist()) == list(range(length - budget, length))
