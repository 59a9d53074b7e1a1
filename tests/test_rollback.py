"""A rollback (``cache.crop``) rolls back the retrieval state kept beside the KV (issue 52,
``runtime/rollback.py``): after a crop the next decode step selects exactly as a fresh cache
fed the kept tokens, for the runtime's ``SpeContextCache`` and Hugging Face's ``StaticCache``.

Budget 12 of a 40-token prompt (the gather path: asserted by the path counters, never the
dense shortcut), fp32, the same compiled graphs on both sides: logits within 1e-5.
``recency_fallback_steps`` stays what the fresh cache counts: the step after the crop used
the kept token's lagged query (before issue 52 it selected by recency, 0.12 off)."""

import pytest
import torch
from transformers import StaticCache

import specontext_compile as sc
from specontext_compile.runtime.static_state import path_counts
from specontext_compile.tiny_models import tiny_family

ATOL = 1e-5
OPTIONS = {"budget": 12, "recent_window": 3, "sink_tokens": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_family("llama", "sdpa")


def _tokens(seed, n):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, kind):
    if kind == "specontext":
        return sc.SpeContextCache(model.config, max_cache_len=64)
    return StaticCache(config=model.config, max_cache_len=64)


def _counts(cache):
    return cache.path_counts() if isinstance(cache, sc.SpeContextCache) else path_counts(cache)


def _feed(forward, cache, ids, one_by_one=True):
    """Logits of the last position of each call; ``ids`` fed one token per call, or whole."""
    out = []
    with torch.no_grad():
        for chunk in (ids.split(1, dim=1) if one_by_one else [ids]):
            out.append(forward(input_ids=chunk, past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("kind,inner,verify_whole", [
    ("specontext", "eager", False), ("static", "eager", False),
    ("specontext", "auto", False), ("specontext", "eager", True), ("static", "eager", True)])
def test_after_a_crop_the_next_steps_select_as_a_fresh_cache_fed_the_kept_tokens(model, kind, inner, verify_whole):
    """Prompt, 6 draft tokens (one by one, or as one verification step: assisted decoding),
    ``crop(-3)``, then 4 other tokens one by one; a fresh cache is fed the prompt, the 3 kept
    tokens (the same way) and the same 4 tokens. Their 4 decode steps: equal logits (1e-5),
    every site gathered on both, and the cropped cache counts no more recency fallbacks
    than the fresh one."""
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(OPTIONS, inner=inner))
    prompt, drafts, others = _tokens(1, 40), _tokens(2, 6), _tokens(3, 4)
    cropped, fresh = _cache(model, kind), _cache(model, kind)
    _feed(forward, cropped, prompt, one_by_one=False)
    _feed(forward, cropped, drafts, one_by_one=not verify_whole)
    cropped.crop(-3)
    assert cropped.get_seq_length() == 43
    before = _counts(cropped)
    got = _feed(forward, cropped, others)
    after = _counts(cropped)
    _feed(forward, fresh, prompt, one_by_one=False)
    _feed(forward, fresh, drafts[:, :3], one_by_one=not verify_whole)
    fresh_before = _counts(fresh)
    want = _feed(forward, fresh, others)
    fresh_after = _counts(fresh)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    steps = {k: after[k] - before[k] for k in after}
    fresh_steps = {k: fresh_after[k] - fresh_before[k] for k in fresh_after}
    assert steps["decode_steps"] == 4 and steps["gather_sites"] == 4 * 2, steps  # 2 layers, every one gathered
    assert steps["dense_store_sites"] == 0, steps
    assert steps == fresh_steps
    assert steps["recency_fallback_steps"] == 0  # the kept token's own query selected the step after the crop


def test_a_crop_deeper_than_the_history_selects_by_recency(model):
    """``ROLLBACK_TOKENS`` + 1 tokens dropped: the kept token's query is no longer in the
    history; the next step selects by recency (counted) and runs (attention exact over it)."""
    from specontext_compile.runtime.rollback import ROLLBACK_TOKENS

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(OPTIONS, inner="eager"))
    cache = sc.SpeContextCache(model.config, max_cache_len=128)
    _feed(forward, cache, _tokens(1, 20), one_by_one=False)
    _feed(forward, cache, _tokens(2, ROLLBACK_TOKENS + 2))
    cache.crop(-(ROLLBACK_TOKENS + 1))
    before = cache.path_counts()["recency_fallback_steps"]
    _feed(forward, cache, _tokens(3, 1))
    assert cache.path_counts()["recency_fallback_steps"] == before + 1


def test_reset_static_cache_never_restores_the_previous_prompts_query(model):
    """Hugging Face resets a StaticCache and reuses it for the next prompt; a prefill run
    eagerly (its compile_config path) records nothing, and the history of the previous
    prompt holds an entry stamped with the new length: its fingerprint (the store's key row)
    differs, so the step selects by recency, as a fresh cache does (equal logits, 1e-5)."""
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(OPTIONS, inner="eager"))
    reused, fresh = _cache(model, "static"), _cache(model, "static")
    _feed(forward, reused, _tokens(1, 40), one_by_one=False)
    _feed(forward, reused, _tokens(2, 4))
    reused.reset()
    new_prompt, steps = _tokens(4, 41), _tokens(5, 3)
    for cache in (reused, fresh):
        _feed(model.forward, cache, new_prompt, one_by_one=False)  # eager prefill: nothing recorded
    got, want = _feed(forward, reused, steps), _feed(forward, fresh, steps)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_fused_draft_head_after_a_crop_reads_the_kept_tokens_hidden_states(tmp_path):
    """A fused draft head (EAGLE-3 layout: its key of token ``t`` reads the auxiliary layers'
    hidden states of token ``t - 1``): prompt, 6 tokens one by one, ``crop(-3)``, 4 other
    tokens. The head's keys of every kept and new position equal a fresh cache's fed the kept
    tokens (before issue 52 the key after the crop read zeros: differs by far more than
    1e-5), and so do the logits and the selection path."""
    from _tiny import tiny_llama
    from test_draft_head_backend import options, write_head

    model = tiny_llama(layers=4)
    folder = write_head(tmp_path, model, heads=4, kv_heads=2, variant="fused", aux=(0, 1, 2))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext",
                            options=options(folder, budget=12, recent_window=3, sink_tokens=2, page_rescue=0))
    prompt, drafts, others = _tokens(1, 40), _tokens(2, 6), _tokens(3, 4)

    def cache():
        return sc.SpeContextCache(model.config, max_cache_len=64, retrieval_head=str(folder))

    cropped, fresh = cache(), cache()
    _feed(forward, cropped, prompt, one_by_one=False)
    _feed(forward, cropped, drafts)
    cropped.crop(-3)
    got = _feed(forward, cropped, others)
    _feed(forward, fresh, prompt, one_by_one=False)
    _feed(forward, fresh, drafts[:, :3])
    want = _feed(forward, fresh, others)
    assert int(cropped.draft.length) == int(fresh.draft.length) == 47
    torch.testing.assert_close(cropped.draft.keys[:, :, :47], fresh.draft.keys[:, :, :47], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert cropped.path_counts()["recency_fallback_steps"] == fresh.path_counts()["recency_fallback_steps"] == 0


def test_previous_hidden_reads_only_the_entry_recorded_for_that_position():
    """``previous_hidden``: the entry of position ``start - 1`` when stamped ``start``; zeros for
    the first token, an entry forgotten by a crop, or one overwritten by a later position
    (a crop deeper than the history)."""
    from specontext_compile.runtime.aten_step import record_hidden
    from specontext_compile.runtime.draft_retrieval import previous_hidden
    from specontext_compile.runtime.rollback import ROLLBACK_TOKENS as R

    state, stamps = torch.zeros(2, 1 + R, 3), torch.zeros(1 + R, dtype=torch.long)
    hidden = [torch.arange(2 * 40 * 2, dtype=torch.float32).view(2, 40, 2), torch.ones(2, 40, 1)]
    record_hidden(state, stamps, hidden, torch.tensor(40))  # positions 0..39: the last R kept
    torch.testing.assert_close(state[:, :1], torch.cat([h[:, 39:40] for h in hidden], -1))  # row 0: the last token
    torch.testing.assert_close(previous_hidden(state, stamps, torch.tensor(40)), state[:, :1])
    want = torch.cat([h[:, 38:39] for h in hidden], -1)
    torch.testing.assert_close(previous_hidden(state, stamps, torch.tensor(39)), want)
    assert not previous_hidden(state, stamps, torch.tensor(0)).any()  # the first token
    assert not previous_hidden(state, stamps, torch.tensor(40 - R)).any()  # position 39 - R: overwritten
    assert previous_hidden(state, stamps, torch.tensor(41 - R)).any()  # the oldest kept, 40 - R
    stamps.masked_fill_(stamps > 30, 0)  # what DraftKeyCache.crop(30) does
    assert not previous_hidden(state, stamps, torch.tensor(35)).any()
    torch.testing.assert_close(previous_hidden(state, stamps, torch.tensor(30)), torch.cat([h[:, 29:30] for h in hidden], -1))


def test_prompt_lookup_decoding_selects_from_the_models_own_queries_after_its_crops(model):
    """The issue's case: ``generate(prompt_lookup_num_tokens=3)`` on a repetitive prompt, budget
    12, crops every rejected candidate (counted: at least one crop ran); no decode step
    selected by recency (before issue 52 each step after a crop did)."""
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(OPTIONS))
    base = _tokens(0, 10)
    ids = torch.cat([base, base, base, base[:, :5]], 1)  # the lookup finds candidates in it
    cache = sc.SpeContextCache(model.config, max_cache_len=128)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    original = model.forward
    model.forward = forward
    try:
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=20, do_sample=False, cache=cache)
    finally:
        model.forward = original
    counts = cache.path_counts()
    assert any(n < 0 for n in crops), crops
    assert counts["decode_steps"] > 0 and counts["gather_sites"] == 2 * counts["decode_steps"], counts
    assert counts["recency_fallback_steps"] == 0, counts
