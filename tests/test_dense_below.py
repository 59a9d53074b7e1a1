"""Option ``dense_below`` (issue 51): a store of at most that many tokens attends densely (exact),
decided once per compile by the rewrite pass from the store's static capacity (the route
"dense", runtime/routes.py). Checked: the path the step takes (counters, no selection), its
logits against eager dense, the negative case one token below, and the option's errors."""

from __future__ import annotations

import pytest
import torch
from _tiny import compiled_steps, decode_graph_ops, tiny_llama

import specontext_compile as sc
from specontext_compile.backend import clear_compile_reports

STEPS = 3


def _eager_logits(model, ids, steps):
    """Greedy decode logits of the model without the backend (dense, exact)."""
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("bad", [-1, True, "auto", 1.5])
def test_the_option_refuses_what_it_cannot_read(bad):
    with pytest.raises(ValueError, match="dense_below"):
        sc.SpeContextConfig(dense_below=bad)


@pytest.mark.parametrize("inner", ["auto", "eager"])
def test_a_store_at_or_below_the_option_attends_densely_and_makes_no_selection(inner):
    """``dense_below`` at the store's capacity: every decode site takes the dense route over its
    store (counters), the step inserts no selection, and the logits are eager dense's; one
    token below the capacity, the same step is sparse (negative case)."""
    model = tiny_llama(layers=2)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    capacity = ids.shape[1] + STEPS + 1  # compiled_steps' cache
    clear_compile_reports()
    logits, cache = compiled_steps(model, ids, STEPS, budget=8, sink_tokens=2, recent_window=2, inner=inner,
                                   dense_below=capacity)
    counts = cache.path_counts()
    assert counts["dense_store_sites"] == 2 * STEPS and counts["gather_sites"] == 0, counts
    assert decode_graph_ops("head_select") == 0
    torch.testing.assert_close(logits, _eager_logits(model, ids, STEPS), atol=1e-4, rtol=1e-4)
    clear_compile_reports()
    _, cache = compiled_steps(model, ids, STEPS, budget=8, sink_tokens=2, recent_window=2, inner=inner,
                              dense_below=capacity - 1)
    assert cache.path_counts()["gather_sites"] == 2 * STEPS and decode_graph_ops("head_select") == 1


def test_a_model_whose_sliding_window_sites_stay_sparse_gives_its_full_sites_every_slot():
    """Gemma-3 (a sliding window of 24 tokens at layer 0, full attention at layer 1): with ``dense_below`` at the store's
    capacity its full-attention sites take the dense route while its windowed sites still
    select (a route is per site), so the step keeps its selection and each dense site reads
    every slot of its store, not the selection (which is smaller than the store). A budget
    covering the window keeps the windowed site exact, so the logits are eager dense's."""
    from specontext_compile.tiny_models import tiny_family

    model = tiny_family("gemma3", "sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    capacity = ids.shape[1] + STEPS + 1
    logits, cache = compiled_steps(model, ids, STEPS, budget=32, sink_tokens=2, recent_window=2, page_rescue=0,
                                   dense_below=capacity)
    counts = cache.path_counts()
    layers = model.config.num_hidden_layers
    assert layers == 2 and counts["dense_store_sites"] == STEPS and counts["gather_sites"] == STEPS, counts
    torch.testing.assert_close(logits, _eager_logits(model, ids, STEPS), atol=1e-4, rtol=1e-4)
