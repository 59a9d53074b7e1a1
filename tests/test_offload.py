"""KV offload on tiny random Llamas: exactness, elastic loading, faults, schedule, trace.

Every run compiles the same model twice (offload off / on) with a budget smaller than the
context, so the selection really changes between steps and layers really leave the
(emulated) device tier during decoding.
"""

import json
import logging
import time

import pytest
import torch
from torch._dynamo.utils import counters

import specontext_compile as sc
from specontext_compile.runtime.offload import OffloadCopyError, enable_offload
from specontext_compile.passes.schedule import CostModel
from specontext_compile.passes.sites import is_op
from specontext_compile.runtime import cpu_kernels, cpu_refine, offload_step
from specontext_compile.runtime.protocol import op_arguments
from _tiny import tiny_llama

PROMPT, STEPS, CAP = 60, 50, 128
# most runs here use the eager op chain (fast to build); the reference without offload runs
# the same chain, so logits must match bit for bit. The compiled offloaded step (inner="auto",
# inductor) has tests of its own below.
# page_rescue=0: the default turns it off with offload, so the resident reference must too
OPTS = {"budget": 16, "recent_window": 4, "sink_tokens": 2, "inner": "eager", "page_rescue": 0}


def _ids(seed=0):
    return torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _run(forward, cache, ids, steps, after_step=None):
    """Prefill then greedy decode; logits of every call. ``after_step(i)`` runs after each
    decode call (i = 0 for the first decode step)."""
    out = []
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for i in range(steps):
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
            if after_step is not None:
                after_step(i)
    return out


def _reference(model, ids, steps=STEPS):
    forward = torch.compile(model.forward, backend="specontext", options=OPTS)
    out = _run(forward, sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP), ids, steps)
    torch._dynamo.reset()
    return out


class _Offloaded:
    """Compiled forward with offload + a cache whose device tier is sized after prefill."""

    def __init__(self, model, size_fn, **manager_kwargs):
        self.forward = torch.compile(model.forward, backend="specontext",
                                     options=dict(OPTS, device_memory_bytes=1 << 40))
        self.cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
        self.manager = enable_offload(self.cache, model, 1 << 40, OPTS["budget"], **manager_kwargs)
        self.size_fn = size_fn
        self._sized = False

    def __call__(self, **kwargs):
        out = self.forward(**kwargs)
        if not self._sized:  # after prefill: the stores exist, size the device tier
            mm = self.manager.prepare()
            self.manager.prepare(self.size_fn(mm))
            self._sized = True
        return out


def _progressive(mm):
    # one layer must go at the first decode step (61 tokens), more as the output grows
    return mm.device_bytes(PROMPT, 0)


def _all_at_once(mm):
    return mm.device_bytes(PROMPT + 1, mm.offloadable)


def _assert_same(a_list, b_list):
    for step, (a, b) in enumerate(zip(a_list, b_list)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"decode call {step}")


@pytest.mark.parametrize("size_fn", [_progressive, _all_at_once], ids=["progressive", "all"])
def test_offload_on_vs_off_identical_logits_for_50_steps(size_fn):
    model, ids = tiny_llama(layers=3), _ids()
    ref = _reference(model, ids)
    run = _Offloaded(model, size_fn)
    out = _run(run, run.cache, ids, STEPS)
    _assert_same(out, ref)  # same selection, same arithmetic: bit-identical
    m = run.manager
    assert m.offloaded == [2, 1, 0][: len(m.offloaded)], "last layers go first"
    assert len(m.offloaded) >= 2
    for length, layer in m.offload_events:  # every offload happened at its threshold
        i = m.offloaded.index(layer)
        assert length >= m.thresholds[i]
    assert counters["specontext"]["offloaded_attention_calls"] > STEPS
    if size_fn is _all_at_once:
        assert [e[0] for e in m.offload_events] == [PROMPT + 1] * 3
    else:
        # by hand: a token of one layer is 2 heads x (16 + 16) x 4 B = 256 B; the device
        # tier holds 3 layers x 60 tokens; an offloaded layer costs 16 rows + a 256 B slot
        # map. ST[0] = 61; ST[1]: 2 S + 16 + 1 <= 180 -> S <= 81 -> 82; ST[2]: 147 (> 110)
        assert m.thresholds[:3] == [61, 82, 147]
        assert m.offload_events == [(61, 2), (82, 1)]


def test_offloaded_attention_reads_the_device_buffer():
    """Corrupting an offloaded layer's buffer changes the output: attention reads it."""
    model, ids = tiny_llama(layers=2), _ids(1)
    run = _Offloaded(model, _all_at_once)
    _run(run, run.cache, ids, 3)
    buf = run.manager.buffers[1]
    with torch.no_grad():
        clean = run.forward(input_ids=ids[:, :1], cache=run.cache, use_cache=True).logits
        run.manager.rollback()
        buf.values.mul_(-1.0)  # slots stay "loaded", so no copy repairs them
        bad = run.forward(input_ids=ids[:, :1], cache=run.cache, use_cache=True).logits
    assert (clean - bad).abs().max() > 1e-3


def test_elastic_loading_buffer_matches_host_tier_and_moves_only_the_difference():
    model, ids = tiny_llama(layers=3), _ids(2)
    run = _Offloaded(model, _all_at_once)
    m = run.manager
    row_bytes = 2 * 16 * 4  # K and V of one head: head_dim 16, fp32
    prev = {}
    checked = []

    def check(step):
        sel = m.selection
        stats = m.stats[-1]
        for layer_idx, buf in m.buffers.items():
            layer = run.cache.layers[layer_idx]
            slots = buf.slots_of(sel, layer.keys.shape[2])
            valid = sel >= 0
            assert bool((slots[valid] >= 0).all()), "every selected token is on the device tier"
            b, h, _ = sel.shape
            for bi in range(b):
                for hi in range(h):
                    pos = sel[bi, hi][valid[bi, hi]]
                    sl = slots[bi, hi][valid[bi, hi]]
                    torch.testing.assert_close(buf.keys[bi, hi, sl], layer.keys[bi, hi, pos], atol=0, rtol=0)
                    torch.testing.assert_close(buf.values[bi, hi, sl], layer.values[bi, hi, pos], atol=0, rtol=0)
            now = [set(sel[bi, hi][valid[bi, hi]].tolist()) for bi in range(b) for hi in range(h)]
            before = prev.get(layer_idx, [set()] * len(now))
            diff_rows = sum(len(n - p) for n, p in zip(now, before))
            assert stats.per_layer_rows.get(layer_idx, 0) == diff_rows, f"step {step} layer {layer_idx}"
            prev[layer_idx] = now
        assert stats.bytes_elastic == sum(stats.per_layer_rows.values()) * row_bytes
        assert stats.bytes_full_reload == int((sel >= 0).sum()) * row_bytes * len(m.buffers)
        checked.append(step)

    _run(run, run.cache, ids, 30, after_step=check)
    assert len(checked) == 30
    later = m.stats[1:]
    elastic = sum(s.bytes_elastic for s in later)
    full = sum(s.bytes_full_reload for s in later)
    assert 0 < elastic < 0.5 * full  # tiny random model: selections overlap a lot


def test_without_elastic_loading_every_step_reloads_the_selection_and_stays_exact():
    model, ids = tiny_llama(layers=2), _ids(3)
    ref = _reference(model, ids, 12)
    run = _Offloaded(model, _all_at_once, elastic=False)
    _assert_same(_run(run, run.cache, ids, 12), ref)
    for s in run.manager.stats:
        assert s.bytes_elastic == s.bytes_full_reload > 0


def test_slowed_copy_gives_identical_results():
    model, ids = tiny_llama(layers=3), _ids(4)
    ref = _reference(model, ids, 15)
    run = _Offloaded(model, _all_at_once)
    run.manager.fault_hook = lambda layer: time.sleep(0.01)
    _assert_same(_run(run, run.cache, ids, 15), ref)


def test_failing_copy_raises_at_the_wait_keeps_host_tier_and_recovers_after_rollback():
    model, ids = tiny_llama(layers=3), _ids(5)
    ref = _reference(model, ids, 12)
    run = _Offloaded(model, _all_at_once)
    m = run.manager
    out = _run(run, run.cache, ids, 5)
    state = {"fail": True}

    def fail_once(layer):
        if layer == 1 and state["fail"]:
            state["fail"] = False
            raise OSError("injected DMA failure")

    m.fault_hook = fail_once
    cached = int(run.cache.layers[0].cumulative_length)
    host = [(l.keys[:, :, :cached].clone(), l.values[:, :, :cached].clone()) for l in run.cache.layers]
    nxt = out[-1].argmax(-1, keepdim=True)
    with torch.no_grad():
        with pytest.raises(OffloadCopyError, match="prefetch of layer 1 failed.*host tier is intact"):
            run.forward(input_ids=nxt, cache=run.cache, use_cache=True)
        for layer, (k, v) in zip(run.cache.layers, host):
            assert torch.equal(layer.keys[:, :, :cached], k) and torch.equal(layer.values[:, :, :cached], v)
        with pytest.raises(OffloadCopyError, match="rollback"):  # no silent decoding on
            run.forward(input_ids=nxt, cache=run.cache, use_cache=True)
        m.rollback()
        assert [int(l.cumulative_length) for l in run.cache.layers] == [cached] * 3
        logits = run.forward(input_ids=nxt, cache=run.cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(6):
            logits = run.forward(input_ids=logits.argmax(-1, keepdim=True), cache=run.cache, use_cache=True).logits[:, -1]
            out.append(logits)
    _assert_same(out, ref)
    assert counters["specontext"]["offload_copy_failures"] == 1


def test_schedule_pass_places_prefetch_early_and_wait_right_before_attention():
    model, ids = tiny_llama(layers=4), _ids(6)
    run = _Offloaded(model, _all_at_once)
    _run(run, run.cache, ids, 2)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert len(decode) == 1
    gm = decode[0].graph_module
    schedule = gm.meta["specontext_offload_schedule"]
    assert schedule.layers == [0, 1, 2, 3] and schedule.lead >= 1
    # the rewrite pass routed the four sites to "offload" (runtime/routes.py): the schedule moved exactly those
    assert dict(decode[0].result.routes) == {"offload": 4}
    nodes = list(gm.graph.nodes)
    ops = torch.ops.specontext
    pos = {n: i for i, n in enumerate(nodes)}
    plans = [n for n in nodes if is_op(n, ops.offload_plan)]
    prefetch = {n.meta["specontext_schedule"]["layer"]: n for n in nodes if is_op(n, ops.offload_prefetch)}
    attn = {layer: next(u for u in p.users if u.target is offload_step.attention) for layer, p in prefetch.items()}
    writes = [n for n in nodes if is_op(n, ops.kv_write)]
    assert len(plans) == 1 and len(prefetch) == len(attn) == 4
    assert op_arguments(plans[0], ops.offload_plan)["run"] is True  # the schedule turned the cache's plan on
    for layer in range(4):
        assert op_arguments(prefetch[layer], ops.offload_prefetch)["layer"].args == (plans[0], layer)
        assert pos[plans[0]] < pos[prefetch[layer]] < pos[attn[layer]]
        assert attn[layer].args[0][1] is prefetch[layer]  # its rows wait for its own ticket
        assert attn[layer].args[0][2] is op_arguments(writes[layer], ops.kv_write)["key_cache"]  # its layer's rows
        assert pos[prefetch[layer]] < pos[writes[max(0, layer - schedule.lead)]]  # issued early
        if layer - schedule.lead > 0:  # ... but not before it needs to be
            assert pos[prefetch[layer]] > pos[writes[layer - schedule.lead - 1]]


def test_the_schedule_moves_only_the_sites_routed_to_offload(monkeypatch):
    """The schedule reads the pass's decision and never decides: a site the pass did not route
    to ``"offload"`` (here layer 0, forced to ``"gather"``) keeps its ``sparse_attention`` op,
    and the schedule prefetches for the other layers only."""
    from specontext_compile.runtime import routes

    real, calls = routes.decide, []

    def first_gathers(*args):
        calls.append(args)
        return routes.Decision("gather", "a test") if len(calls) == 1 else real(*args)

    monkeypatch.setattr(routes, "decide", first_gathers)
    model, ids = tiny_llama(layers=4), _ids(6)
    run = _Offloaded(model, lambda mm: mm.device_bytes(PROMPT + 1, 0))  # every layer stays on the device
    _run(run, run.cache, ids, 1)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert len(decode) == 1 and dict(decode[0].result.routes) == {"gather": 1, "offload": 3}
    gm = decode[0].graph_module
    assert gm.meta["specontext_offload_schedule"].layers == [1, 2, 3]
    kept = [n for n in gm.graph.nodes if is_op(n, torch.ops.specontext.sparse_attention)]
    moved = [n for n in gm.graph.nodes if n.target is offload_step.attention]
    assert len(kept) == 1 and len(moved) == 3 and op_arguments(kept[0], torch.ops.specontext.sparse_attention)[
        "spec"].route == "gather"


def test_default_path_has_no_offload_ops():
    model, ids = tiny_llama(layers=2), _ids(7)
    forward = torch.compile(model.forward, backend="specontext", options=OPTS)
    _run(forward, sc.SpeContextCache(model.config, max_cache_len=CAP), ids, 2)
    code = "\n".join(r.graph_module.code for r in sc.compile_reports())
    for name in ("offload_plan", "offload_prefetch", "offload_rows", "offload_step", "offload=True", "route='offload'"):
        assert name not in code, name
    assert "specontext.sparse_attention" in code and "offload=False" in code


@pytest.mark.parametrize("copy_s,compute_s,cap,expected", [
    (1e-3, 3e-4, 8, 4), (1e-3, 3e-4, 3, 3), (1e-5, 1e-3, 4, 1)])
def test_cost_model_lead(copy_s, compute_s, cap, expected):
    bw = 1e9
    cost = CostModel(bandwidth=bw, layer_bytes=compute_s * bw, load_bytes=copy_s * bw, copy_latency=0.0)
    assert cost.lead(cap) == expected


def test_trace_shows_copies_on_the_worker_overlapping_compute(tmp_path):
    model, ids = tiny_llama(layers=3), _ids(8)
    path = tmp_path / "trace.json"
    run = _Offloaded(model, _all_at_once, trace_path=str(path))
    run.manager.fault_hook = lambda layer: time.sleep(0.005)  # copies long enough to see
    _run(run, run.cache, ids, 4)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    copies = [e for e in spans if e["cat"] == "copy" and e["name"].startswith("copy")]
    compute = [e for e in spans if e["cat"] == "compute"]
    waits = [e for e in spans if e["cat"] == "wait"]
    assert len(copies) == 3 and len(waits) == 3 and len(compute) >= 2
    assert {e["tid"] for e in copies}.isdisjoint({e["tid"] for e in compute})
    overlap = any(c["ts"] < k["ts"] + k["dur"] and k["ts"] < c["ts"] + c["dur"] for c in copies for k in compute)
    assert overlap, "a copy on the worker overlaps a layer's compute on the main thread"


def test_offload_options_are_validated():
    with pytest.raises(ValueError, match="device_memory_bytes"):
        sc.SpeContextConfig(device_memory_bytes=0)
    with pytest.raises(ValueError, match="device_memory_bytes"):
        sc.SpeContextConfig(device_memory_bytes=True)
    with pytest.raises(ValueError, match="offload_trace"):
        sc.SpeContextConfig(offload_trace="t.json")
    assert sc.SpeContextConfig(device_memory_bytes=1 << 30).device_memory_bytes == 1 << 30


def _tier_offloading_at_66(model):
    """A hand-sized device tier for a 2-layer tiny Llama decoding 20 tokens after a 60-token
    prompt: weights x1.3 + retrieval state (with its rollback history) + selection + page bounds (the stores hold 60 + 20
    + 1 = 81 tokens: ceil((81 + 15) / 16) = 6 pages x 2 layers x min and max of 2 KV heads x
    16 fp32) + 65 tokens of KV in both layers (2 layers x 2 KV heads x (16 + 16) x 4 B = 512 B
    per token), so the plan must offload a layer when the cache reaches 66 tokens (ST[0] =
    66)."""
    from specontext_compile.runtime.offload import model_weight_bytes
    from specontext_compile.runtime.rollback import QUERY_SLOTS  # current slots + rollback history

    fixed = QUERY_SLOTS * 6 * 16 * 4 + QUERY_SLOTS * 8 + 2 * 16 * 8 + 6 * 2 * 2 * 2 * 16 * 4
    return -(-13 * model_weight_bytes(model) // 10) + fixed + 512 * 65


@pytest.mark.parametrize("dense_layers", [(), -1], ids=["all-sparse", "dense-last"])
def test_compile_helper_attaches_offload_and_generates_the_same_text(dense_layers):
    """sc.compile(device_memory_bytes=...) attaches the manager and gives the resident run's
    text. With dense_layers=-1 it passes the dense layer to the manager: the plan offloads
    layer 0 (the last *sparse* layer) instead of layer 1, whose dense site reads its store
    on the device, so the offloaded calls are still layer 0's."""
    options = dict(OPTS, dense_layers=dense_layers)
    model, ids = tiny_llama(layers=2), _ids(9)
    sc.compile(model, **options)
    ref = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    sc.api.restore(model)
    torch._dynamo.reset()
    counters.clear()
    # ST[0] = 66; with one layer offloaded the other fits to the end (81 tokens)
    sc.compile(model, device_memory_bytes=_tier_offloading_at_66(model), **options)
    out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    assert counters["specontext"]["offloaded_layers"] == 1
    # decode steps j = 1..19 reach 60 + j tokens; j >= 6 (>= 66 tokens) run offloaded
    assert counters["specontext"]["offloaded_attention_calls"] == 14


def test_offload_is_refused_on_cuda_devices_with_the_fix_named():
    from specontext_compile.runtime.offload import check_offload_device

    check_offload_device(torch.device("cpu"))  # the emulated tiers: allowed
    with pytest.raises(NotImplementedError, match="Drop device_memory_bytes"):
        check_offload_device(torch.device("cuda", 0))


def test_offload_ops_declare_effects_and_take_the_manager_as_a_graph_input(caplog):
    """Issue 15 item 2: every offload op has an ordered effect (compilers keep and order
    them), and the manager reaches them as an explicit graph input — the decode graph's
    placeholder of cache.offload feeds every offload op; there is no store-pointer lookup.
    A cache without a manager gets no offload ops and a warning naming the fix."""
    import logging

    from torch._higher_order_ops.effects import _get_effect
    from specontext_compile.backend import compile_reports
    from specontext_compile.runtime import offload as offload_mod

    ops = torch.ops.specontext
    for op in (ops.offload_plan, ops.offload_prefetch, ops.offload_rows):
        assert _get_effect(op.default) is not None, op
    assert not hasattr(offload_mod, "lookup") and not hasattr(offload_mod, "_REGISTRY")
    model, ids = tiny_llama(layers=2), _ids(9)
    run = _Offloaded(model, _all_at_once)
    _run(run, run.cache, ids, 3)
    decode = next(r for r in reversed(compile_reports()) if r.result.phase == "decode").graph_module
    managers = [n for n in decode.graph.nodes if n.op == "placeholder" and "offload" in n.name]
    assert len(managers) == 1
    users = {str(u.target).split(".")[1] for u in managers[0].users if str(u.target).startswith("specontext.")}
    assert {"offload_plan", "offload_prefetch"} <= users
    rows = [n for n in decode.graph.nodes if n.target is offload_step.attention]
    assert len(rows) == 2 and all(n.args[0][0] is managers[0] for n in rows)  # its attention reads through it
    assert run.manager.offloaded  # the plan ran through the graph's manager
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=dict(OPTS, device_memory_bytes=1 << 40))
    with caplog.at_level(logging.WARNING, logger="specontext_compile.passes.schedule"):
        bare = _run(forward, sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP), ids, 3)
    assert any("has no offload manager" in r.getMessage() for r in caplog.records)
    _assert_same(bare, _reference(model, ids, 3))


def _resident(model, ids, options, steps):
    """The reference without offload: (logits of every call, its cache); dynamo and the
    counters reset afterwards, so the offloaded run that follows counts alone."""
    forward = torch.compile(model.forward, backend="specontext", options=options)
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
    ref = _run(forward, cache, ids, steps)
    torch._dynamo.reset()
    counters.clear()
    return ref, cache


class _OffloadedTwoStage(_Offloaded):
    """Offload with the two-stage selection: device buffers hold the step's candidates."""

    def __init__(self, model, size_fn, options, **manager_kwargs):
        self.forward = torch.compile(model.forward, backend="specontext",
                                     options=dict(options, device_memory_bytes=1 << 40))
        self.cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
        rows = sc.SpeContextConfig(**options).buffer_tokens
        self.manager = enable_offload(self.cache, model, 1 << 40, rows, **manager_kwargs)
        self.size_fn, self._sized = size_fn, False


# progressive offload is checked by test_offload_on_vs_off_identical_logits_for_50_steps; its twin here: slow tier
@pytest.mark.parametrize("size_fn", [pytest.param(_progressive, marks=pytest.mark.slow), _all_at_once],
                         ids=["progressive", "all"])
def test_two_stage_selection_with_offload_equals_resident_bit_for_bit(size_fn):
    """candidates=2 (issue 12): the step prefetches its 32 candidates per KV head; an offloaded
    layer refines them from its device buffer and attends to its 16 from the same buffer."""
    options = dict(OPTS, candidates=2.0)
    model, ids = tiny_llama(layers=3), _ids()
    ref, _ = _resident(model, ids, options, STEPS)
    run = _OffloadedTwoStage(model, size_fn, options)
    out = _run(run, run.cache, ids, STEPS)
    _assert_same(out, ref)
    assert len(run.manager.offloaded) >= 2
    assert all(buf.keys.shape[2] == 32 for buf in run.manager.buffers.values())  # candidate rows
    c = counters["specontext"]
    # an offloaded layer refines and attends from its buffer every step; layer 0 joins later
    assert STEPS <= c["offloaded_refine_calls"] == c["offloaded_attention_calls"] <= 3 * STEPS
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    graph = decode[-1].graph_module.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    refines = [n for n in graph.nodes if n.target is offload_step.refine]
    assert len(refines) == 3
    for refine in refines:
        prefetch = refine.args[0][1]  # rows = (manager, ticket, key_cache, value_cache)
        assert prefetch.target is torch.ops.specontext.offload_prefetch.default and order[prefetch] < order[refine]
        assert op_arguments(prefetch, torch.ops.specontext.offload_prefetch)["indices"] is refine.args[2]


def test_offload_buffers_smaller_than_the_candidates_name_the_fix():
    options = dict(OPTS, candidates=2.0)
    model, ids = tiny_llama(layers=2), _ids()
    forward = torch.compile(model.forward, backend="specontext", options=dict(options, device_memory_bytes=1 << 40))
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
    enable_offload(cache, model, 1 << 40, OPTS["budget"])  # budget rows, not the 32 candidates
    with pytest.raises(Exception, match=r"ceil\(candidates \* budget\)"):
        _run(forward, cache, ids, 2)


# progressive offload is checked by test_offload_on_vs_off_identical_logits_for_50_steps; its twin here: slow tier
@pytest.mark.parametrize("size_fn", [pytest.param(_progressive, marks=pytest.mark.slow), _all_at_once],
                         ids=["progressive", "all"])
def test_page_rescue_with_offload_equals_resident_bit_for_bit(size_fn):
    """page_rescue (issue 12): an offloaded layer scores its pages from bounds kept on the
    device, loads the rescued tokens it lacks from the host tier on demand (counted), and
    gives the logits of the same options without offload, bit for bit."""
    options = dict(OPTS, candidates=2.0, page_rescue=16)
    model, ids = tiny_llama(layers=3), _ids()
    ref, resident = _resident(model, ids, options, STEPS)
    assert resident.path_counts()["page_rescue_sites"] == 3 * STEPS
    run = _OffloadedTwoStage(model, size_fn, options)
    out = _run(run, run.cache, ids, STEPS)
    _assert_same(out, ref)
    assert len(run.manager.offloaded) >= 2
    assert all(buf.keys.shape[2] == 32 + 16 for buf in run.manager.buffers.values())  # candidates + rescue
    assert counters["specontext"]["offloaded_refine_calls"] > 0
    assert sum(s.rescued_rows for s in run.manager.stats) > 0  # rescued tokens came from the host tier
    assert run.cache.path_counts()["page_rescue_sites"] == 3 * STEPS


def test_offload_buffers_without_room_for_the_rescue_grow_and_say_so(caplog):
    """Buffers of only the candidates' rows (a manager built by hand with the candidates'
    count, as before the rescue existed): the offloaded layer grows its buffer, logs the fix
    (buffer_tokens), and the logits stay those of the resident run, bit for bit."""
    options = dict(OPTS, candidates=2.0, page_rescue=16)
    model, ids = tiny_llama(layers=2), _ids()
    ref, _ = _resident(model, ids, options, 3)
    run = _OffloadedTwoStage(model, _all_at_once, options)
    run.manager = enable_offload(run.cache, model, 1 << 40, sc.SpeContextConfig(**options).prefetch_tokens)
    with caplog.at_level(logging.WARNING, logger="specontext_compile.runtime.offload"):
        out = _run(run, run.cache, ids, 3)
    _assert_same(out, ref)
    assert "buffer_tokens" in caplog.text
    assert all(buf.keys.shape[2] > 32 for buf in run.manager.buffers.values())


def test_dense_layers_with_offload_stay_on_the_device_and_equal_resident_bit_for_bit():
    """dense_layers=-1 with offload (issue 12): the last layer attends densely over its whole
    store every step, so the plan never offloads it and offloads the last *sparse* layers
    first (1, then 0; without the rule it would take layer 2 first). The memory model caps the
    offloaded layers at L - 1 and keeps the resident layer's rows: sized to hold the run's last
    length (110 tokens) with both others offloaded, one more step no longer fits."""
    options = dict(OPTS, dense_layers=-1)
    model, ids = tiny_llama(layers=3), _ids()
    ref, resident = _resident(model, ids, options, STEPS)
    assert resident.path_counts()["sparse_sites"] == 2 * STEPS  # layer 2 dense, 0 and 1 sparse
    last = PROMPT + STEPS  # the cache's length after the run
    run = _OffloadedTwoStage(model, lambda mm: mm.device_bytes(last, mm.offloadable), options,
                             resident_layers=options["dense_layers"])
    out = _run(run, run.cache, ids, STEPS)
    _assert_same(out, ref)
    m = run.manager
    assert m.resident == (2,) and m.model.resident_layers == 1 and m.model.offloadable == 2
    assert [layer for _, layer in m.offload_events] == [1, 0], m.offload_events  # never layer 2
    # by hand: with both others offloaded, each token costs the resident layer one row of
    # 2 KV heads x (16 + 16) x 4 B = 256 B, and nothing else grows
    assert m.model.device_bytes(last + 1, 2) - m.model.device_bytes(last, 2) == 256
    assert len(m.thresholds) == 3 and m.thresholds[2] == last + 1
    assert m.summary()["resident_layers"] == [2]
    assert counters["specontext"]["offloaded_attention_calls"] > STEPS
    assert run.cache.path_counts()["sparse_sites"] == 2 * STEPS
    with pytest.raises(Exception, match="kept on the device by dense_layers"):
        run(input_ids=out[-1].argmax(-1, keepdim=True), cache=run.cache, use_cache=True)


def test_dense_layers_naming_every_layer_leave_nothing_to_offload():
    model = tiny_llama(layers=2)
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
    with pytest.raises(ValueError, match="keep fewer layers dense or unset device_memory_bytes"):
        enable_offload(cache, model, 1 << 40, OPTS["budget"], resident_layers=(0, -1))


# ------------------------------------------------------------------ the compiled offloaded step
COMPILED = {"budget": 16, "recent_window": 4, "sink_tokens": 2}  # inner="auto": inductor; page rescue on


@pytest.mark.parametrize("reorder", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["greedy", "beam-reorder"])
def test_offloaded_step_compiles_with_inductor_and_equals_resident_bit_for_bit(reorder):
    """Issue 27 item 5 (field case beam_reorder_state CASE06b): at the default options (page
    rescue on) the offloaded decode graph is lowered and compiled by inductor like the
    resident one — only the row moves stay ops — so offloaded and resident logits are
    bit-identical, as layers leave the device one by one, and after a beam reorder. The
    layer index reaches the ops as a tensor, so regional compilation shares the repeated
    layer's code: with 4 layers, the middle two (the first layer also plans the step's
    transfers and the last prefetches no next layer, so 3 layers repeat none). Where our CPU
    refine kernel builds, both steps run it (an offloaded layer over the rows it loaded)."""
    layers = 4
    model, ids = tiny_llama(layers=layers), torch.cat([_ids(), _ids(1)])
    perm = torch.tensor([1, 0])

    def after(cache):
        def hook(i):
            if reorder and i == 4:
                cache.reorder_cache(perm)
        return hook

    forward = torch.compile(model.forward, backend="specontext", options=COMPILED)
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
    ref = _run(forward, cache, ids, 12, after(cache))
    resident_counts = cache.path_counts()
    torch._dynamo.reset()
    counters.clear()
    refined_before = cpu_kernels.kernel_calls()["cpu_kernel_refine_calls"]  # Python and C++ operator kernels
    run = _OffloadedTwoStage(model, _progressive, COMPILED)
    out = _run(run, run.cache, ids, 12, after(run.cache))
    _assert_same(out, ref)
    assert run.cache.path_counts() == resident_counts and resident_counts["page_rescue_sites"] == layers * 12
    m, c = run.manager, counters["specontext"]
    assert len(m.offloaded) >= 2 and sum(s.rescued_rows for s in m.stats) > 0
    # each offloaded site refines and attends from one read of its buffer (the lowering fused
    # them: offload_step.refine_and_attend); layers left one by one
    assert c["offloaded_refine_calls"] == 0 and 12 < c["offloaded_attention_calls"] < layers * 12
    # the offloaded sites ran our refine kernel over their loaded rows, as the resident ones did
    assert (cpu_kernels.kernel_calls()["cpu_kernel_refine_calls"] > refined_before) == cpu_refine.available()
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"][-1]
    assert decode.lowered is not None and decode.lowered.fused == layers  # inductor ran, one body per site
    assert set(decode.lowered.kept) == {"specontext::offload_*", "specontext::check_capacity"}
    assert c["regions"] > c["regions_compiled"]  # the repeated layer compiled once


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_offloaded_compiled_step_reads_the_device_buffer():
    """The compiled offloaded step's attention reads the buffer: corrupting an offloaded
    layer's rows changes the output (no copy repairs slots marked loaded)."""
    model, ids = tiny_llama(layers=2), _ids(1)
    run = _OffloadedTwoStage(model, _all_at_once, COMPILED)
    _run(run, run.cache, ids, 3)
    with torch.no_grad():
        clean = run.forward(input_ids=ids[:, :1], cache=run.cache, use_cache=True).logits
        run.manager.rollback()
        run.manager.buffers[1].values.mul_(-1.0)
        bad = run.forward(input_ids=ids[:, :1], cache=run.cache, use_cache=True).logits
    assert (clean - bad).abs().max() > 1e-3
