"""benchmarks.guard_estimate measures the shipped selection, not a stand-in.

The first version passed ``query_valid = 1`` to ``lagged_query_scores``: the head then fell
back to recency scores at every step, so its tables measured a recency selection. These
tests pin the lagged query's own picks and the page-rescue measurement (the backend's own functions)."""

import torch

from benchmarks.guard_estimate import measure, page_rescued

D, KV, H = 8, 1, 2


def _crafted(context: int, steps: int, far: int):
    """Keys where the lagged query (layer 0) attends almost only to position ``far``."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, KV, context + steps, D, generator=g) * 0.01
    keys[0, 0, far] = 1.0
    q = torch.full((1, H, 1, D), 6.0)
    return [{0: q} for _ in range(steps)], {0: keys}


def test_measure_uses_the_lagged_query_not_recency():
    context, steps, far = 64, 2, 20
    queries, keys = _crafted(context, steps, far)
    rows = measure(queries, keys, context, D ** -0.5, budget=4, candidates=1.0, sink=1, window=2,
                   retrieval=(0,))
    # position `far` holds nearly all the attention: recency (sink + last 3) would miss it
    assert rows and all(r["recall"] > 0.9 for r in rows), rows


def test_page_rescued_adds_the_best_page_of_the_layers_own_query():
    n, far = 96, 50
    _, keys = _crafted(n - 1, 1, far)
    cand = torch.tensor([[[-1, 0, 93, 94]]])
    query = torch.full((1, H, 1, D), 6.0)
    out = page_rescued(cand, query, keys[0], D ** -0.5, tokens=16)
    assert out.shape[:2] == (1, KV)
    kept = set(out[0, 0].tolist()) - {-1}
    assert {0, 93, 94} <= kept and far in kept and len(kept) == 3 + 16
    assert torch.equal(out[..., :4], cand.expand(1, KV, 4))  # the candidates first, unchanged
    # the rescued tokens are the page holding `far` (pages of 16: 48..63)
    assert set(range(48, 64)) <= kept


def test_measure_with_page_rescue_recovers_a_token_the_candidates_miss():
    context, far = 64, 20
    (current,), keys = _crafted(context, 1, far)
    queries = [{0: -current[0]}, current]  # the lagged query points away from `far`
    keys = {0: torch.cat([keys[0], keys[0][:, :, -1:]], dim=2)}
    without = measure(queries, keys, context, D ** -0.5, 4, 1.0, 1, 2, (0,))
    with_pages = measure(queries, keys, context, D ** -0.5, 4, 1.0, 1, 2, (0,), page_rescue=16)
    assert without[0]["recall"] < 0.5 and with_pages[0]["recall"] > 0.9


def test_page_rescued_padding_clears_nothing():
    """-1 padding in the candidates marks no position (it once cleared position 0)."""
    n, far = 96, 5
    _, keys = _crafted(n - 1, 1, far)
    out = page_rescued(torch.tensor([[[-1, -1, 93, 94]]]), torch.full((1, H, 1, D), 6.0), keys[0], D ** -0.5, 16)
    assert set(range(16)) | {93, 94} == set(out[0, 0].tolist()) - {-1}
