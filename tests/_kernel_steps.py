"""A compiled default step with one of our CPU kernels and with the torch body it replaces."""

from __future__ import annotations

import torch
from _tiny import tiny_llama
from test_backend_e2e import decode_logits
from torch._dynamo.utils import counters

import specontext_compile as sc

OPTIONS = {"budget": 8, "page_rescue": 16}  # the default's shape at a tiny context: refined sites, page rescue


def with_and_without(module, counter: str, monkeypatch, steps: int = 4):
    """``(calls, got, want)``: ``counter``'s calls over ``steps`` decode steps of tiny Llama
    compiled by inductor with the default options, those steps' logits, and the logits of the
    same step compiled with ``module.applies`` returning False (the torch body; the compile
    caches off, since they key on our sources and options, not on a patched function). The
    second run adds no call (asserted)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def run():
        compiled = torch.compile(model.forward, backend="specontext", options=OPTIONS)
        return decode_logits(model, compiled, ids, steps, sc.SpeContextCache(model.config, max_cache_len=64))

    before = counters["specontext"][counter]
    got = run()
    calls = counters["specontext"][counter] - before
    torch._dynamo.reset()
    monkeypatch.setattr(module, "applies", lambda *a, **k: False)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        want = run()
    assert counters["specontext"][counter] - before == calls
    return calls, got, want
