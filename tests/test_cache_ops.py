"""Hugging Face's cache operations against every piece of state a SpeContextCache keeps
(issue 13 item 5; the table is in runtime/README.md, "Cache operations").

States: the KV stores, the retrieval state (``query_state`` rows, ``query_valid``), the path
counters, the draft head's key cache (``draft``: keys, length, aux_state, aux_valid) and the
offload tier (``OffloadManager`` buffers and slot maps). Operations: ``reorder_cache``
(beam search), ``crop`` (assisted / prompt-lookup decoding), ``reset`` (reuse for a new
prompt), ``batch_select_indices`` / ``batch_repeat_interleave``.

Small budget: each operation must leave the cache equal to one that got there without it
(rows permuted / selected / repeated: the same logits with the rows moved, exactly; a
reset: a fresh cache). Full budget, gather path (``dense_shortcut=False``): ``generate``
with beam search, prompt-lookup decoding and a reused cache equals eager dense ``generate``.
The resident cache runs the default step (lowered into inductor); offload runs the eager op
chain (the backend's rule while the offload manager is an opaque graph input), and so does the
draft head here (its state is what these tests move; the draft head on the default step is
``test_draft_head_backend.py::test_inductor_inner_matches_eager_inner``). Each kind's forward
is compiled once for the module and shared by its tests (``shared_compile``): every test
builds fresh caches, and the compiled step reads nothing else.
"""

import pytest
import torch
from _tiny import tiny_llama
from test_backend_e2e import assert_gather_path
from test_draft_head_backend import write_head

import specontext_compile as sc
from specontext_compile.runtime.offload import OffloadCopyError, enable_offload
from specontext_compile.tiny_models import tiny_family

pytestmark = pytest.mark.xdist_group("test_cache_ops")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

CAP = 48
OPTS = {"budget": 10, "recent_window": 3, "sink_tokens": 2}
# the same compiled step over rows moved between calls; a new batch size can be a new graph,
# whose float32 rounding may differ: a bound well above that rounding
ATOL = 1e-6
KINDS = ["resident", "draft", "offload"]


class Runner:
    """A compiled forward and fresh caches of one kind (resident, a fused draft head, or
    every layer offloaded from the first decode step)."""

    def __init__(self, kind, folder):
        self.kind = kind
        self.model = tiny_llama(layers=4) if kind == "draft" else tiny_family("llama", "sdpa")
        opts = dict(OPTS)
        self.head = None
        if kind == "draft":
            self.head = str(write_head(folder, self.model, heads=4, kv_heads=2, variant="fused", aux=(0, 1, 2)))
            opts["retrieval_head"] = self.head
            opts["inner"] = "eager"
        if kind == "offload":
            opts["device_memory_bytes"] = 1 << 40
        # isolate_recompiles: the kinds' forwards share Hugging Face's code objects; each keeps
        # its own graphs and recompile limit (what specontext_compile.compile does)
        self.forward = torch.compile(self.model.forward, backend="specontext", options=opts,
                                     isolate_recompiles=True)

    def cache(self):
        cache = sc.SpeContextCache(self.model.config, max_cache_len=CAP, retrieval_head=self.head)
        if self.kind == "offload":
            enable_offload(cache, self.model, 1 << 40, OPTS["budget"])
        return cache

    def step(self, cache, ids):
        first = self.kind == "offload" and int(cache.get_seq_length()) == 0
        with torch.no_grad():
            logits = self.forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        if first:  # offload every layer at the first decode step
            mm = cache.offload.prepare()
            cache.offload.prepare(mm.device_bytes(ids.shape[1] + 1, mm.num_layers))
        return logits

    def decode(self, cache, logits, steps):
        out = []
        for _ in range(steps):
            logits = self.step(cache, logits.argmax(-1, keepdim=True))
            out.append(logits)
        return out, logits


@pytest.fixture(scope="module")
def runner(shared_dynamo, tmp_path_factory):
    """``runner(kind)``: the module's one :class:`Runner` of that kind (compiled once)."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = Runner(kind, tmp_path_factory.mktemp(f"head_{kind}"))
        return made[kind]

    return get


def prompts(batch, length, seed):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_rows(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def assert_sparse(cache):
    counts = cache.path_counts()
    assert counts["gather_sites"] > 0 and counts["decode_steps"] > 0, counts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.shared_compile
def test_reorder_cache_moves_every_row_state(kind, runner):
    """Beam-style reorder (repeats allowed) after 2 decode steps: the next 3 steps equal the
    un-reordered run's rows in the new order (budget 10 < context 23..28)."""
    r = runner(kind)
    ids, idx = prompts(3, 20, 11), torch.tensor([2, 2, 0])
    plain = r.cache()
    _, last = r.decode(plain, r.step(plain, ids), 2)
    want, _ = r.decode(plain, last, 3)

    moved = r.cache()
    _, last = r.decode(moved, r.step(moved, ids), 2)
    before = moved.query_state.clone() if moved.query_state is not None else None
    moved.reorder_cache(idx)
    if before is not None:
        assert torch.equal(moved.query_state, before[:, idx])
    got, _ = r.decode(moved, last[idx], 3)
    assert_rows(got, [w[idx] for w in want])
    assert_sparse(moved)
    if kind == "offload":
        assert moved.offload.offloaded and all(
            torch.equal(moved.offload.buffers[i].pos_of_slot, plain.offload.buffers[i].pos_of_slot[idx])
            for i in moved.offload.offloaded)


# resident: slow tier (its 2- and 4-row steps are new graphs of the default step, ~100 s cold);
# the fast tier moves rows of the offloaded cache (the op chain)
@pytest.mark.parametrize("kind", [k if k == "offload" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
@pytest.mark.shared_compile
def test_batch_select_and_repeat_move_every_row_state(kind, runner):
    """3 rows, 2 steps, keep rows [2, 0] (2 steps), then repeat each twice (1 step): the
    rows of the untouched run, selected and repeated."""
    r = runner(kind)
    ids, sel = prompts(3, 20, 12), torch.tensor([2, 0])
    plain = r.cache()
    _, last = r.decode(plain, r.step(plain, ids), 2)
    want, _ = r.decode(plain, last, 3)

    cache = r.cache()
    _, last = r.decode(cache, r.step(cache, ids), 2)
    cache.batch_select_indices(sel)
    assert cache.batch_size == 2 and cache.query_state.shape[1] == 2
    got, last = r.decode(cache, last[sel], 2)
    if kind == "offload":  # the tier was sized for 3 rows; 4 need more (else DeviceMemoryError)
        cache.offload.device_memory_bytes = 1 << 40
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4
    got3, _ = r.decode(cache, last.repeat_interleave(2, 0), 1)
    assert_rows(got, [w[sel] for w in want[:2]])
    assert_rows(got3, [want[2][sel].repeat_interleave(2, 0)])
    if kind == "draft":
        assert cache.draft.keys.shape[0] == cache.draft.aux_state.shape[0] == 4
    assert_sparse(cache)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.shared_compile
def test_crop_rolls_back_every_state(kind, runner):
    """Assisted decoding's rollback: 3 rejected tokens (a 2-token and a 1-token step),
    crop(-3), go on.
    Equals a cache that never saw them (issue 52: the kept token's lagged query and the fused
    draft head's hidden states come back from their histories, runtime/rollback.py)."""
    r = runner(kind)
    ids = prompts(3, 20, 13)  # 3 rows, as the other tests: the shared graphs serve them all
    ref = r.cache()
    _, last = r.decode(ref, r.step(ref, ids), 3)
    want, _ = r.decode(ref, last, 3)

    cache = r.cache()
    _, last = r.decode(cache, r.step(cache, ids), 3)
    r.step(cache, torch.tensor([[5, 6], [7, 8], [1, 2]]))  # rejected candidates: a 2-token step
    r.step(cache, torch.tensor([[9], [4], [3]]))  # (dense: max_sparse_q_len=1) and a sparse 1-token step
    n = 23
    if kind == "offload":  # the sparse step loaded its own token into the buffers
        assert all(int(b.pos_of_slot.max()) == n + 2 for b in cache.offload.buffers.values())
    cache.crop(-3)
    assert all(int(layer.cumulative_length) == n for layer in cache.layers)
    assert not cache.layers[0].keys[:, :, n:].any()  # dropped slots hold zeros again
    if cache.draft is not None:
        assert int(cache.draft.length) == n and not cache.draft.keys[:, :, n:].any()
    if kind == "offload":
        assert cache.offload.offloaded
        assert all(int(b.pos_of_slot.max()) < n for b in cache.offload.buffers.values())
    got, _ = r.decode(cache, last, 3)
    assert_rows(got, want)
    assert_sparse(cache)


@pytest.mark.shared_compile
def test_crop_into_the_prompt_equals_a_fresh_cache(runner):
    """crop(-6) right after a compiled prefill equals a fresh cache given the shorter prompt
    by an eager prefill (which records no query either), over 4 sparse steps."""
    r = runner("resident")
    ids = prompts(3, 26, 14)
    cache = r.cache()
    r.step(cache, ids)
    cache.crop(-6)
    fresh = r.cache()
    with torch.no_grad():  # eager: no backend, no recorded query
        logits = r.model(input_ids=ids[:, :20], cache=fresh, use_cache=True).logits[:, -1]
    want, _ = r.decode(fresh, logits, 4)
    got, _ = r.decode(cache, logits, 4)
    assert_rows(got, want)
    assert_sparse(cache)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.shared_compile
def test_reset_then_new_prompt_equals_a_fresh_cache(kind, runner):
    """Prompt A (prefill + 5 steps), reset, prompt B: logits, path counters, draft length and
    offload plan equal a fresh cache's on B."""
    r = runner(kind)
    a, b = prompts(3, 22, 15), prompts(3, 18, 16)
    fresh = r.cache()
    want, _ = r.decode(fresh, r.step(fresh, b), 5)

    cache = r.cache()
    r.decode(cache, r.step(cache, a), 5)
    cache.reset()
    got, _ = r.decode(cache, r.step(cache, b), 5)
    assert_rows(got, want)
    assert cache.path_counts() == fresh.path_counts()
    assert_sparse(cache)
    if kind == "draft":
        assert int(cache.draft.length) == int(fresh.draft.length) == 23
    if kind == "offload":
        assert cache.offload.offload_events == fresh.offload.offload_events
        assert [s.length for s in cache.offload.stats] == [s.length for s in fresh.offload.stats]


@pytest.mark.shared_compile
def test_unsupported_calls_are_clear_errors(runner):
    r = runner("offload")
    cache = r.cache()
    r.step(cache, prompts(2, 12, 17))
    with pytest.raises(ValueError, match=r"crop\(-k\)"):
        cache.crop(3)
    with pytest.raises(ValueError, match="holds only 12"):
        cache.crop(-13)
    with pytest.raises(ValueError, match="batch_select_indices"):
        cache.reorder_cache(torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="out of range"):
        cache.batch_select_indices(torch.tensor([2]))
    cache.batch_select_indices(torch.tensor([False, True]))  # a bool mask keeps row 1
    assert cache.batch_size == 1
    cache.offload._failed = "prefetch of layer 1 failed"  # a failed step, not rolled back
    with pytest.raises(OffloadCopyError, match="rollback"):
        cache.reorder_cache(torch.tensor([0]))
    cache.reset()  # reset starts over
    assert cache.offload._failed is None and not cache.offload.offloaded
    with pytest.raises(ValueError, match="batch_repeat_interleave"):  # reuse with another batch size
        r.step(cache, prompts(3, 12, 18))


def generate_model():
    model = tiny_family("llama", "sdpa")
    base = prompts(1, 9, 19)
    ids = torch.cat([base, base, base[:, :5]], 1)  # repeats: prompt lookup finds candidates
    return model, ids


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_generate_beam_search_prompt_lookup_and_reuse_equal_eager_at_full_budget(inner):
    """Full budget, gather path: num_beams=3 (reorder_cache every step), prompt-lookup
    decoding (crop of rejected tokens) and a cache reset and reused for another prompt all
    equal eager dense generate. The fast tier runs it on the eager op chain (its beam, prompt
    lookup and reuse graphs compile in seconds); the default step's twin is in the slow tier
    (about 45 s of inductor compiles), the fast tier's default-step tests of the same cache
    operations being the ones above."""
    model, ids = generate_model()
    other = prompts(1, 20, 20)
    kw = dict(max_new_tokens=8, do_sample=False)
    ref_beam = model.generate(ids, num_beams=3, **kw)
    ref_lookup = model.generate(ids, prompt_lookup_num_tokens=3, **kw)
    ref_other = model.generate(other, num_beams=3, **kw)
    sc.compile(model, budget=64, dense_shortcut=False, inner=inner)

    cache = sc.SpeContextCache(model.config, max_cache_len=40)
    assert torch.equal(model.generate(ids, num_beams=3, cache=cache, **kw), ref_beam)
    assert_gather_path(cache, 2 * 7)
    cache.reset()  # reused: a new prompt, same batch (3 beams)
    assert torch.equal(model.generate(other, num_beams=3, cache=cache, **kw), ref_other)
    assert_gather_path(cache, 2 * 7)

    crops = []
    cache = sc.SpeContextCache(model.config, max_cache_len=40)
    real = cache.crop
    cache.crop = lambda n: (crops.append(n), real(n))[1]
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, cache=cache, **kw), ref_lookup)
    assert any(n < 0 for n in crops), crops  # rejected candidates were cropped
    counts = cache.path_counts()
    assert counts["gather_sites"] == counts["sparse_sites"] > 0 and counts["dense_store_sites"] == 0, counts
