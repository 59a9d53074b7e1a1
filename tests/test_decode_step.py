"""The decode step with no host in the loop (issue 11): sync-free ops, lowered to aten,
compiled whole by inductor, with the path counters the compiled step keeps itself."""

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from test_backend_e2e import ATOL, RTOL, decode_logits
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from transformers import DynamicCache

import specontext_compile as sc
from specontext_compile.passes.gemv import one_row_linear, rewrite_one_row_linears
from specontext_compile.runtime import aten_step, scorers
from benchmarks.host_selection import select_tokens
from specontext_compile.runtime.spec import AttentionVariant, StepSpec


def _step_codes(model, options, prompt=40, steps=3, capacity=64):
    """Prefill + ``steps`` decode calls through the backend; (inductor code strings of the
    decode graph, the cache, logits)."""
    compiled = torch.compile(model.forward, backend="specontext", fullgraph=True, options=options)
    cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = compiled(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        out, codes = run_and_get_code(lambda: compiled(input_ids=nxt, cache=cache, use_cache=True))
        for _ in range(steps - 1):
            out = compiled(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), cache=cache, use_cache=True)
    return codes, cache, out


def test_default_decode_graph_is_one_inductor_graph_without_our_ops():
    """fullgraph=True (a graph break would raise), inductor compiled the decode graph, and
    its generated code calls no specontext op (no Python fallback) but the one capacity
    check before layer 0's write (a host read, free on CPU) and, where they build, our C++
    kernels of the refined sites (``cpu_refine_attention``) and of the selection
    (``cpu_selection_scores``), extern calls inductor keeps: everything else was lowered."""
    import re

    from specontext_compile.runtime import cpu_refine, cpu_selection

    model = tiny_llama(layers=3)
    codes, cache, _ = _step_codes(model, {"budget": 16, "recent_window": 4, "sink_tokens": 2})
    assert codes, "inductor compiled nothing for the decode step"
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.specontext\.(\w+)\.default\(", code)
    ours = {"check_capacity", "cpu_refine_attention", "cpu_selection_scores"}
    assert calls.count("check_capacity") == 1 and set(calls) <= ours, calls
    assert ("cpu_refine_attention" in calls) == cpu_refine.available(), calls
    assert ("cpu_selection_scores" in calls) == cpu_selection.available(), calls
    assert "cpp_fused" in code  # inductor's own C++ kernels
    assert counters["specontext"]["ops_lowered"] >= 3 + 3 + 1  # 3 writes, 3 sparse sites, 1 selection
    assert not counters["graph_break"]
    # the compiled step counted itself: 3 decode steps, 3 gather sites each, each refined with
    # the default page rescue (issue 12, third pass), lowered too (no op call above)
    assert cache.path_counts() == {"decode_steps": 3, "sparse_sites": 9, "gather_sites": 9, "dense_store_sites": 0,
                                   "guard_dense_sites": 0, "page_rescue_sites": 9,
                                   "recency_fallback_steps": 0}
    # each refined site's refinement and attention were lowered as one body (logits once)
    from specontext_compile.backend import compile_reports

    assert [r.lowered.fused for r in compile_reports() if r.result.phase == "decode"] == [3]


def test_unlowered_inductor_graph_calls_our_ops():
    """The negative: with ``lower=False`` the same graph calls the ops back (what the
    lowering removes)."""
    model = tiny_llama(layers=2)
    codes, _, _ = _step_codes(model, {"budget": 16, "inner": "inductor", "lower": False})
    assert "specontext" in "\n".join(codes)
    assert counters["specontext"]["ops_lowered"] == 0


@pytest.mark.parametrize("budget, path", [pytest.param(16, "gather_sites", marks=pytest.mark.slow),
                                          pytest.param(64, "dense_store_sites", marks=pytest.mark.slow)])
def test_inductor_step_equals_eager_step(budget, path):
    """Same logits (fp32 rounding) from the inductor-compiled step and the eager op chain,
    small budget (gather path) and a budget covering the store (dense shortcut)."""
    model = tiny_llama(layers=3)
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(3))
    runs = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="specontext",
                                 options={"budget": budget, "inner": inner, "recent_window": 4})
        cache = sc.SpeContextCache(model.config, max_cache_len=64)
        runs[inner] = decode_logits(model, compiled, ids, 12, cache), cache.path_counts()
    for step, (a, b) in enumerate(zip(runs["eager"][0], runs["inductor"][0])):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    assert runs["eager"][1] == runs["inductor"][1]
    assert runs["inductor"][1][path] == 3 * 12 and runs["inductor"][1]["decode_steps"] == 12


def test_full_budget_without_shortcut_runs_the_gather_path_exactly():
    """Budget >= context with the dense shortcut off: every step gathers (the counters say
    so) and still equals eager dense decoding (issue 12's honest exactness test)."""
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(0))
    eager = decode_logits(model, model.forward, ids, 20, DynamicCache(config=model.config))
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 64, "dense_shortcut": False})
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    sparse = decode_logits(model, compiled, ids, 20, cache)
    for step, (a, b) in enumerate(zip(sparse, eager)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    assert cache.path_counts() == {"decode_steps": 20, "sparse_sites": 80, "gather_sites": 80, "dense_store_sites": 0,
                                   "guard_dense_sites": 0, "page_rescue_sites": 0,
                                   "recency_fallback_steps": 0}


def test_hf_default_compile_mode_compiles_with_inductor_and_runs_sparse(caplog):
    """Hugging Face's CompileConfig passes mode="reduce-overhead": honoured (inductor with
    its CUDA-graph setting, which inductor skips for CPU graphs), not ignored."""
    from transformers import CompileConfig

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 25))
    config = CompileConfig(backend="specontext")  # mode="reduce-overhead", no options
    config._compile_all_devices = True  # HF compiles only on accelerators otherwise
    cache = sc.api.make_cache(model, ids, 4)
    model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache, compile_config=config)
    assert "ignored" not in caplog.text
    assert counters["specontext"]["ops_lowered"] > 0  # inductor compiled the lowered graph
    assert cache.path_counts()["sparse_sites"] == 2 * 3


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        sc.SpeContextConfig(mode="fastest")


# ------------------------------------------------------------------ sync-free by construction


def test_decode_ops_never_read_a_tensor_value_on_the_host():
    """Run every aten body on the meta device: a host read (``int(t)``, ``bool(t)``,
    ``.item()``, a data-dependent shape) raises there, so passing proves the step needs no
    device-to-host sync (what CUDA graph capture requires)."""
    meta = torch.device("meta")
    b, h, kv, cap, d = 2, 6, 2, 96, 16
    keys = torch.empty(b, kv, cap, d, device=meta)
    values = torch.empty(b, kv, cap, d, device=meta)
    length = torch.empty((), dtype=torch.long, device=meta)
    aten_step.write_kv(keys, values, length, torch.empty(b, kv, 1, d, device=meta),
                       torch.empty(b, kv, 1, d, device=meta))
    state = torch.empty(8, b, h, 1, d, device=meta)
    valid = torch.empty(8, dtype=torch.long, device=meta)
    aten_step.record_query(state, valid, torch.empty(b, h, 1, d, device=meta), 2, length)
    for window in (0, 24):
        spec = StepSpec(32, 32, sink_tokens=4, recent_window=8)
        idx = scorers.speculative_select((state, valid), [keys, keys], length, 1, spec,
                                           AttentionVariant(0.25, sliding_window=window))
        assert idx.shape == (b, kv, 32)
        mask = torch.empty(b, 1, 1, cap, device=meta)
        out = aten_step.sparse_attention(torch.empty(b, h, 1, d, device=meta), keys, values, idx, length, mask,
                                         spec, AttentionVariant(0.25, sliding_window=window))
        assert out.shape == (b, h, 1, d)
    full_spec = StepSpec(4096, 4096, sink_tokens=4, recent_window=8, dense_shortcut=True, route="dense")
    full = scorers.speculative_select((state, valid), [keys], length, 1, full_spec, AttentionVariant(0.25))
    out = aten_step.sparse_attention(torch.empty(b, h, 1, d, device=meta), keys, values, full, length, None,
                                     full_spec, AttentionVariant(0.25))
    draft = scorers.draft_select(torch.empty(b, 4, 1, d, device=meta),
                                   (torch.empty(b, 4, cap, d, device=meta), length), keys, length, 1,
                                   StepSpec(32, 32, sink_tokens=4, recent_window=8), AttentionVariant(0.25))
    assert draft.shape == (b, kv, 32)
    aten_step.count_step(torch.empty(4, dtype=torch.long, device=meta), [1, 2, 3, 4])


# ------------------------------------------------------------------ selection: static = dynamic


@st.composite
def selection_cases(draw):
    capacity = draw(st.integers(4, 80))
    q_len = draw(st.integers(1, 3))
    cached = draw(st.integers(0, capacity - q_len))
    slots = draw(st.integers(q_len, capacity))
    sink = draw(st.integers(0, 6))
    window = draw(st.integers(0, 10))
    sliding = draw(st.sampled_from([0, 0, 5, 17]))
    seed = draw(st.integers(0, 2**16))
    return capacity, q_len, cached, slots, sink, window, sliding, seed


@settings(max_examples=200, deadline=None)
@given(selection_cases())
def test_static_selection_equals_the_sliced_one(case):
    """``select_positions`` (static shapes, masks) picks the same set as a by-hand Python
    selection at the host-known length (:func:`_selection_by_hand`) for distinct scores,
    padding included."""
    capacity, q_len, cached, slots, sink, window, sliding, seed = case
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randperm(capacity, generator=gen).float().view(1, 1, capacity).expand(2, 3, capacity)
    scores = scores + torch.rand(2, 3, capacity, generator=gen) * 0.5  # distinct per row
    garbage = scores.clone()
    garbage[..., cached:] = float("nan")  # never looked at
    got = aten_step.select_positions(garbage, torch.tensor(cached), q_len, slots, sink, window, sliding)
    assert got.shape == (2, 3, slots)
    for bi in range(2):
        for h in range(3):
            want = _selection_by_hand(scores[bi, h, :cached].tolist(), cached + q_len, q_len, slots, sink, window,
                                      sliding)
            assert sorted(got[bi, h].tolist()) == sorted(want)
    wrapped = select_tokens(scores[..., :cached], cached + q_len, q_len, slots, sink, window, sliding)
    assert torch.equal(wrapped, got)  # the host entry point runs the same code


def _selection_by_hand(scores: list[float], length: int, q_len: int, slots: int, sink: int, window: int,
                       sliding: int) -> list[int]:
    """The selection rule in plain Python: the visible positions (all, or the sliding window of
    the step's rows); if they fit, all of them and -1 padding; else the last
    ``max(window, q_len)`` (capped by ``slots``), the first ``sink`` (none with a sliding
    window, capped by what is left), then the best scores."""
    start = max(0, length - q_len - sliding + 1) if sliding else 0
    visible = list(range(start, length))
    if len(visible) <= slots:
        return [-1] * (slots - len(visible)) + visible
    recent = min(max(window, q_len), slots)
    sinks = 0 if sliding else min(sink, slots - recent)
    forced = set(visible[-recent:]) | set(visible[:sinks])
    rest = sorted((p for p in visible if p not in forced), key=lambda p: -scores[p])
    return sorted(forced) + rest[: slots - len(forced)]


# ------------------------------------------------------------------ one-row linears


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.booleans(), st.integers(0, 2**16))
def test_one_row_linear_equals_linear(k, n, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, 1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(one_row_linear(x, w, b).double(), want, atol=1e-5, rtol=1e-5)


def _linear_graph(shape):
    def f(x, w):
        return F.linear(x, w)

    gm = torch.fx.symbolic_trace(f)
    x_node, w_node = list(gm.graph.nodes)[:2]
    x_node.meta["example_value"] = torch.empty(shape)
    w_node.meta["example_value"] = torch.empty(5, shape[-1])
    return gm


@pytest.mark.parametrize("shape, rewritten", [((1, 1, 8), 1), ((1, 8), 1), ((2, 1, 8), 0), ((1, 3, 8), 0)])
def test_only_one_row_linears_are_rewritten(shape, rewritten):
    """Batch 1 decode rows are rewritten; two rows (batch 2 or a 3-token step) keep ``mm``."""
    gm = _linear_graph(shape)
    assert rewrite_one_row_linears(gm.graph) == rewritten
    gm.recompile()
    x, w = torch.randn(shape), torch.randn(5, shape[-1])
    torch.testing.assert_close(gm(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ what the lowering must not touch


def test_lowering_keeps_the_offload_ops_and_lowers_the_rest():
    """Issue 27 item 5: offload ops only move rows and run the plan, so a graph holding them
    is lowered like any other (its KV writes become aten code); the offload ops stay ops,
    with the reason recorded, and the cache's plan marker goes where the schedule did not
    turn it on (``run`` False, nothing reads its layer indices) and stays where it did."""
    from torch import fx

    from specontext_compile.passes.lower import lower_to_aten
    from specontext_compile.runtime import aten_step
    from specontext_compile.runtime import offload_ops  # noqa: F401  (registers the offload ops)

    ops = torch.ops.specontext
    for run in (False, True):
        graph = fx.Graph()
        x = graph.placeholder("x")
        plan = graph.call_function(ops.offload_plan.default, (x, x, x, x, 1, 2), {"run": run})
        graph.call_function(ops.kv_write.default, (x, x, x, x, x, []))
        graph.call_function(ops.offload_rows.default, (x, x, x, x, x, x, True))
        graph.output(None)
        result = lower_to_aten(graph)
        assert result.lowered == {"specontext::kv_write": 1}
        assert result.removed == ({} if run else {"specontext::offload_plan": 1})
        assert "move KV rows" in result.kept["specontext::offload_*"]
        targets = [n.target for n in graph.nodes if n.op == "call_function"]
        assert targets == [plan.target] * run + [aten_step.write_kv, ops.offload_rows.default]


def test_lowering_keeps_the_triton_kernel_and_the_draft_step_as_ops():
    """A site the pass routed to the kernel stays the op off CUDA (the lowering follows the
    route, whatever option ``kernel`` says); a gather site is lowered."""
    from torch import fx

    from specontext_compile.passes.lower import lower_to_aten

    ops = torch.ops.specontext
    graph = fx.Graph()
    x = graph.placeholder("x")
    variant = AttentionVariant(0.5)
    graph.call_function(ops.sparse_attention.default, (x, x, x, x, x, None, StepSpec(4, 4, route="kernel"), variant))
    graph.call_function(ops.sparse_attention.default, (x, x, x, x, x, None, StepSpec(4, 4, kernel="triton"), variant))
    graph.call_function(ops.draft_step.default, (x, x, x, x, x, "head", [x, x, x], False))
    graph.output(None)
    result = lower_to_aten(graph)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets[0] is ops.sparse_attention.default and targets[2] is ops.draft_step.default
    assert targets[1] is not ops.sparse_attention.default  # the torch path was lowered
    assert result.lowered["specontext::sparse_attention"] == 1
    assert set(result.kept) == {"specontext::sparse_attention", "specontext::draft_step"}


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_inductors_cache_keys_on_our_sources():
    """An inductor cache entry compiled by another version of our passes or runtime is never
    reused (``backend._SourcesKey``): the same step compiled again hits inductor's FX graph
    cache, and compiled under another sources hash (the pass's ``uuid``) misses it. Seen
    without it: after the attention op's schema changed, a cached step called the op with
    its old arguments."""
    import uuid

    from specontext_compile.passes.sparse_rewrite import SparseAttentionPass

    model = tiny_llama(layers=2)
    version = uuid.uuid4().hex  # a hash no earlier run compiled under
    options = {"budget": 16, "inner": "inductor", "regional": False}
    seen = {}
    for run in ("first", "again", "other sources"):
        torch._dynamo.reset()
        counters.clear()
        if run == "other sources":
            real = SparseAttentionPass.uuid
            SparseAttentionPass.uuid = lambda self: f"{real(self)}-{version}"
        try:
            _step_codes(model, options, steps=1)
        finally:
            if run == "other sources":
                SparseAttentionPass.uuid = real
        seen[run] = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    assert seen["again"][0] >= 2 and seen["again"][1] == 0, seen  # prefill and decode graphs found
    assert seen["other sources"][0] == 0 and seen["other sources"][1] >= 2, seen
