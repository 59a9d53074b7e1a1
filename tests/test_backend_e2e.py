"""End to end on tiny random Llamas: rewrite counts, exactness, sparsity, recompiles, paths.

Exactness at full budget (budget >= context) is checked on the gather path: the backend
would otherwise attend densely over the store (SDPA, the dense shortcut) and the test would
compare SDPA with SDPA (issue 12). Those tests pass ``dense_shortcut=False`` and assert the
compiled step's own path counters (``cache.path_counts()``: every rewritten site gathered,
none ran dense); one test keeps the shortcut on, to check the shortcut itself.
"""

import pytest
import torch
from _tiny import tiny_llama
from specontext_compile.runtime import aten_step
from torch._dynamo.utils import counters
from transformers import DynamicCache

import specontext_compile as sc

# fp32: compiled gather path (gather + matmul + float32 softmax, dense_shortcut=False) vs
# eager SDPA / HF eager attention; observed max |logit diff| <= 2e-7 on these models, bound
# with margin. Greedy tokens must be equal as well (assert_same_greedy_tokens).
ATOL, RTOL = 1e-4, 1e-4


def decode_logits(model, forward, ids, steps, cache):
    """Prefill then teacher-forced decode with ``forward``; logits of every call."""
    out = []
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            logits = forward(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return out


def assert_gather_path(cache, sites):
    """The compiled step's own path counters (kept under inductor too): ``sites`` sparse
    sites over the decode steps, every one gathered, none attended densely over the store."""
    counts = cache.path_counts()
    assert counts["sparse_sites"] == sites and counts["gather_sites"] == sites, counts
    assert counts["dense_store_sites"] == 0 and counts.get("guard_dense_sites", 0) == 0, counts


def assert_same_greedy_tokens(sparse, eager):
    """Greedy (argmax) tokens of every call equal (a tolerance on logits is not enough)."""
    got = [x.argmax(-1).tolist() for x in sparse]
    want = [x.argmax(-1).tolist() for x in eager]
    assert got == want, f"greedy tokens differ: first at call {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


# the eager-attention case is in the slow tier (the sdpa one checks the same rewrite, docs/testing.md)
FULL_BUDGET_CASES = [("sdpa", False), pytest.param("eager", False, marks=pytest.mark.slow), ("sdpa", True)]


@pytest.mark.parametrize("attn, shortcut", FULL_BUDGET_CASES,
                         ids=["sdpa-gather", "eager-gather", "sdpa-shortcut"])
def test_all_sites_of_tiny_llama_rewritten_and_exact_with_full_budget(attn, shortcut):
    """Budget 64 = the store's capacity, 4 layers, prefill + 20 steps: equal to eager dense.
    ``gather``: the dense shortcut off, every site gathers its (full) selection. ``shortcut``
    (the one end-to-end test of the dense shortcut itself): the default, every site attends
    densely over the store (on CPU under inductor the fused products over every slot, not
    SDPA: test_sparse_attention), as the counters say."""
    model = tiny_llama(layers=4, attn=attn)
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(0))
    eager = decode_logits(model, model.forward, ids, 20, DynamicCache(config=model.config))
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 64, "dense_shortcut": shortcut})
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    sparse = decode_logits(model, compiled, ids, 20, cache)
    for step, (a, b) in enumerate(zip(sparse, eager)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    assert_same_greedy_tokens(sparse, eager)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert len(decode) == 1 and decode[0].sites_total == 4 and decode[0].sites_rewritten == 4
    counts = cache.path_counts()  # counted by the compiled step itself
    if shortcut:
        assert counts["sparse_sites"] == counts["dense_store_sites"] == 4 * 20 and counts["gather_sites"] == 0
    else:
        assert_gather_path(cache, 4 * 20)


def test_small_budget_attends_to_fewer_tokens(monkeypatch):
    attended = []
    real = aten_step.sparse_attention_reference

    def spy(query, key_cache, value_cache, indices, length, *args):
        attended.append(((indices >= 0).sum(-1).max().item(), int(length)))
        return real(query, key_cache, value_cache, indices, length, *args)

    monkeypatch.setattr(aten_step, "sparse_attention_reference", spy)
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model.forward, backend="specontext",
                             options={"budget": 16, "recent_window": 4, "sink_tokens": 2, "inner": "eager"})
    logits = decode_logits(model, compiled, ids, 5, sc.SpeContextCache(model.config, max_cache_len=100))
    assert attended and all(n == 16 and length > 90 for n, length in attended)
    assert all(torch.isfinite(x).all() for x in logits)


def test_dynamic_cache_stays_dense_with_reason():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 20))
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8})
    eager = decode_logits(model, model.forward, ids, 3, DynamicCache(config=model.config))
    dense = decode_logits(model, compiled, ids, 3, DynamicCache(config=model.config))
    for a, b in zip(dense, eager):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    reports = sc.compile_reports()
    assert all(r.sites_rewritten == 0 for r in reports)
    reasons = {reason for r in reports for _, reason in r.result.fallbacks()}
    assert any("SpeContextCache" in reason for reason in reasons)
    assert counters["specontext"]["sparse_attention_calls"] == 0 and counters["specontext"]["ops_lowered"] == 0


def test_compile_helper_generate_runs_rewritten_graph_without_recompiles():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 30))
    ref = model.generate(ids, max_new_tokens=50, min_new_tokens=50, do_sample=False)
    sc.compile(model, budget=128, dense_shortcut=False)  # the gather path, not SDPA over the store
    cache = sc.api.make_cache(model, ids, 50)
    out = model.generate(ids, max_new_tokens=50, min_new_tokens=50, do_sample=False, cache=cache)
    assert torch.equal(out, ref)  # budget >= context: exact, same greedy text
    assert_gather_path(cache, 2 * 49)
    assert counters["specontext"]["graphs"] == 2  # one prefill + one decode graph, 50 steps
    assert sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)) <= 2
    assert sc.path_counts(model) == cache.path_counts()  # the model counts its caches' steps
    model.generate(ids, max_new_tokens=50, min_new_tokens=50, do_sample=False)  # the one-call path
    counts = sc.path_counts(model)  # its cache is gone; the model still says what ran
    assert counts["decode_steps"] == 2 * 49 and counts["gather_sites"] == 2 * 2 * 49, counts


def test_forward_compile_path_with_generate():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 25))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    model.forward = torch.compile(model.forward, backend="specontext", options={"budget": 64, "dense_shortcut": False})
    cache = sc.SpeContextCache(model.config, max_cache_len=40)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert_gather_path(cache, 2 * 11)


def test_generate_compile_config_path():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 25))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    config = sc.api.generation_compile_config(budget=64, dense_shortcut=False)
    cache = sc.api.make_cache(model, ids, 12)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache, compile_config=config)
    assert torch.equal(out, ref)
    # prefill runs eagerly in HF's compile path; every decode step runs compiled, gathering
    assert_gather_path(cache, 2 * 11)


def test_compiled_capacity_overflow_is_a_clear_error():
    model = tiny_llama(layers=1)
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8})
    cache = sc.SpeContextCache(model.config, max_cache_len=16, chunk_tokens=8)  # exactly 16 slots
    ids = torch.randint(0, 128, (1, 15))
    with torch.no_grad():
        compiled(input_ids=ids, cache=cache, use_cache=True)  # fills 15 of 16 slots
        compiled(input_ids=ids[:, :1], cache=cache, use_cache=True)
        with pytest.raises(Exception, match="max_cache_len"):
            compiled(input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert int(cache.layers[0].cumulative_length) == 16  # nothing lost, nothing half-written


def test_eager_cache_grows_in_chunks_and_matches_dynamic_cache():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 20))
    cache = sc.SpeContextCache(model.config, chunk_tokens=8)
    out = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False, cache=cache)
    ref = model.generate(ids, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.layers[0].keys.shape[2] == 56  # 49 tokens in chunks of 8


def test_triton_kernels_run_end_to_end_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    options = {"budget": 16, "recent_window": 4, "sink_tokens": 2}
    runs = {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="specontext",
                                 options=dict(options, kernel=kernel, inner="eager"))
        runs[kernel] = decode_logits(model, compiled, ids, 4, sc.SpeContextCache(model.config, max_cache_len=48))
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    assert counters["specontext"]["triton_attention_calls"] == 2 * 4


def test_the_kernel_route_under_the_default_compile(monkeypatch):
    """kernel='triton' (interpreter) with the default inner compiler (inductor, regional on CPU):
    the sites routed to the kernel stay ops, so the layers compile region by region instead of
    as stitched subgraphs (inductor's code for one named the op's StepSpec without importing
    it: a NameError at the first decode step, found by a review); logits equal the torch
    route's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    runs = {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model.forward, backend="specontext",
                                 options={"budget": 16, "recent_window": 4, "sink_tokens": 2, "kernel": kernel})
        runs[kernel] = decode_logits(model, compiled, ids, 2, sc.SpeContextCache(model.config, max_cache_len=48))
    assert counters["specontext"]["triton_attention_calls"] == 2 * 2
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_soft_capped_and_windowed_sites_take_the_kernel_under_the_interpreter(monkeypatch):
    """Gemma-2 (a logit soft cap at every layer, a sliding window at every other one): the
    generated kernel serves both variants through its own flags (issue 53, item 3: they were
    unreachable) and gives the torch body's logits. The cap is lowered to 0.05 so that it
    shapes every softmax: a kernel that ignored it fails here (checked). The window's
    positions are already the window sites' selection, so the kernel's window flag is checked
    against float64 by tests/test_codegen_attention.py, not here."""
    from specontext_compile.tiny_models import tiny_family

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_family("gemma2", "eager")
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 0.05  # moves the logits by 6e-3 (1.0: 3e-5)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    options = {"budget": 16, "recent_window": 4, "sink_tokens": 2, "inner": "eager"}
    runs, calls = {}, {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model.forward, backend="specontext", options=dict(options, kernel=kernel))
        runs[kernel] = decode_logits(model, compiled, ids, 3, sc.SpeContextCache(model.config, max_cache_len=48))
        calls[kernel] = dict(counters["specontext"])
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    layers = model.config.num_hidden_layers
    assert calls["torch"].get("triton_attention_calls", 0) == 0
    assert calls["triton"]["triton_attention_calls"] == layers * 3, calls["triton"]


def test_the_kernel_route_folds_the_padding_mask_without_a_host_read(monkeypatch):
    """kernel='triton' (interpreter) on a left-padded batch: every decode site takes the kernel
    (the pass decided it once, the one-row bool mask folded into the selection on the device,
    where the op used to read the gathered mask back once per step), and the logits equal the
    torch path's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_llama(layers=3)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :6] = 0
    options = {"budget": 16, "recent_window": 4, "sink_tokens": 2, "inner": "eager", "page_rescue": 0}
    runs, calls = {}, {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model.forward, backend="specontext", options=dict(options, kernel=kernel))
        cache, seen, logits, runs[kernel] = sc.SpeContextCache(model.config, max_cache_len=48), mask, None, []
        with torch.no_grad():
            for step in range(4):
                seen = seen if step == 0 else torch.cat([seen, torch.ones(2, 1, dtype=seen.dtype)], 1)
                logits = compiled(input_ids=ids if step == 0 else logits.argmax(-1, keepdim=True), attention_mask=seen,
                                  cache=cache, use_cache=True).logits[:, -1]
                runs[kernel].append(logits)
        calls[kernel] = counters["specontext"]["triton_attention_calls"]
    assert calls == {"torch": 0, "triton": 3 * 3}, calls
    for a, b in zip(runs["triton"], runs["torch"]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_triton_kernel_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    """kernel='triton' on CPU without ``TRITON_INTERPRET=1``: the compile refuses with the fix
    (the route is decided when the pass runs, before any step)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 16, "kernel": "triton"})
    with pytest.raises(Exception, match="TRITON_INTERPRET=1"):
        decode_logits(model, compiled, ids, 2, sc.SpeContextCache(model.config, max_cache_len=48))


@pytest.mark.slow
def test_batched_left_padded_generation_is_exact_at_full_budget():
    model = tiny_llama(layers=2)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0  # the second request is 7 tokens shorter, padded on the left
    ids[1, :7] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    sc.compile(model, budget=64, dense_shortcut=False)  # the gather path: pad positions masked per row
    cache = sc.api.make_cache(model, ids, 10)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, cache=cache)
    assert torch.equal(out, ref)
    assert_gather_path(cache, 2 * 9)
