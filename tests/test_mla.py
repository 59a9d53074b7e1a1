"""Multi-head latent attention (issue 14 item 1): DeepSeek-V2/V3 sites select on the latent
cache and attend to the selected latent rows only (runtime/mla.py).

References: Hugging Face's own eager dense decoding (end to end), and float64 attention with
keys/values up-projected from the latent rows exactly as Hugging Face's ``expand_kv`` does
(op level)."""

import copy

import pytest
import torch
from _families import DECODE_STEPS, record_caches, run_family, tiny_family
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.passes.sites import find_attention_sites
from specontext_compile.runtime import scorers
from specontext_compile.runtime.mla import latent_query, mla_sparse_attention, up_project
from specontext_compile.runtime.protocol import is_op, op_arguments
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from test_backend_e2e import assert_gather_path, decode_logits

import specontext_compile as sc

MLA = torch.ops.specontext.sparse_attention.default  # at an MLA site its variant has nope_dim > 0
CASES = [(f, a) for f in ("deepseek_v3", "deepseek_v2") for a in ("sdpa", "eager")]


def dense_mla_reference(query, latent, rope, weight, positions, length, scale, nope, mask=None):
    """float64 Hugging Face MLA over ``positions`` only: per-head keys ``[W_UK c ; k_rot]``,
    values ``W_UV c`` (``expand_kv``), causal limit ``p <= length - q_len + row``."""
    b, h, q_len, _ = query.shape
    r = latent.shape[-1]
    w = weight.double().view(h, -1, r)
    c = latent[:, 0, :length].double()  # [b, length, r]: written rows only
    keys = torch.cat([torch.einsum("hnr,bcr->bhcn", w[:, :nope], c),
                      rope[:, 0, :length].double()[:, None].expand(b, h, -1, -1)], -1)
    values = torch.einsum("hvr,bcr->bhcv", w[:, nope:], c)
    logits = query.double() @ keys.transpose(-1, -2) * scale  # [b, h, q, cap]
    if mask is not None:
        logits = logits + mask.double()
    cap = length
    rows = torch.arange(q_len).view(q_len, 1) + length - q_len
    allowed = torch.zeros(b, 1, q_len, cap, dtype=torch.bool)
    for i in range(b):
        sel = torch.zeros(cap, dtype=torch.bool)
        sel[positions[i]] = True
        allowed[i, 0] = sel.view(1, cap) & (torch.arange(cap).view(1, cap) <= rows)
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ values


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), rank=st.sampled_from([8, 16]), rope=st.sampled_from([2, 4]),
       nope=st.sampled_from([4, 8]), value=st.sampled_from([4, 6]), q_len=st.sampled_from([1, 2]),
       length=st.integers(3, 30), keep=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_mla_op_equals_float64_up_projected_attention_over_the_selection(heads, rank, rope, nope, value, q_len,
                                                                         length, keep, seed):
    """Absorbed attention over the selected latent rows == Hugging Face's up-projected
    attention restricted to the same positions (fp32 vs float64, tolerance 1e-5)."""
    g = torch.Generator().manual_seed(seed)
    b, cap = 2, 32
    length = max(length, q_len)
    query = torch.randn(b, heads, q_len, nope + rope, generator=g)
    latent, rope_keys = torch.randn(b, 1, cap, rank, generator=g), torch.randn(b, 1, cap, rope, generator=g)
    latent[:, :, length:] = float("nan")  # unwritten slots are never read
    weight = torch.randn(heads * (nope + value), rank, generator=g) / rank**0.5
    keep = min(keep, length)
    positions = [torch.cat([torch.randperm(length - q_len, generator=g)[: max(keep - q_len, 0)],
                            torch.arange(length - q_len, length)]) for _ in range(b)]
    slots = max(len(p) for p in positions) + 2
    indices = torch.stack([torch.cat([torch.full((slots - len(p),), -1), p.sort().values]) for p in positions])
    out = up_project(mla_sparse_attention(latent_query(query, weight, nope), latent, rope_keys, indices[:, None],
                                          torch.tensor(length), None, StepSpec(1, 1), AttentionVariant(0.3)),
                     weight, nope)
    ref = dense_mla_reference(query, latent, rope_keys, weight, positions, length, 0.3, nope)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_mla_selection_scores_the_latent_cache_like_concatenated_keys():
    """``scorers.speculative_select`` over a (latent, rope) store pair picks exactly what the
    plain selection picks over the concatenated ``[latent ; rope]`` keys (one KV head)."""
    torch.manual_seed(0)
    b, h, cap, r, p = 2, 4, 40, 16, 4
    state = torch.randn(8, b, h, 1, r + p)
    valid = torch.full((8,), 30, dtype=torch.long)
    latent, rope = torch.randn(b, 1, cap, r), torch.randn(b, 1, cap, p)
    args = (torch.tensor(30), 1, StepSpec(12, 12, sink_tokens=2, recent_window=3), AttentionVariant(0.25))
    got = scorers.speculative_select((state, valid), [(latent, rope)], *args)
    want = scorers.speculative_select((state, valid), [torch.cat([latent, rope], -1)], *args)
    assert got.shape == (b, 1, 12)
    assert torch.equal(got, want)


# deepseek_v3 with sdpa is the fast case; eager attention and deepseek_v2 are the slow tier's
# twins (docs/testing.md)
@pytest.mark.parametrize("family,attn", [pytest.param(f, a, id=f"{f}-{a}",
                                                      marks=pytest.mark.slow if (f, a) != ("deepseek_v3", "sdpa") else ())
                                         for f, a in CASES])
def test_mla_family_rewritten_and_exact_at_full_budget_on_the_gather_path(family, attn, monkeypatch):
    """Both MLA sites of every decode graph become the sparse-attention op with an MLA variant; at a budget
    covering the context the logits equal eager dense decoding (gather path, counters)."""
    caches = record_caches(monkeypatch)
    r = run_family(family, attn, dense_shortcut=False)
    assert (r["decode_rewritten"], r["decode_sites"]) == (2, 2), r["reasons"]
    assert r["max_err"] < 1e-4
    assert_gather_path(caches[-1], 2 * DECODE_STEPS)
    sites = [s for rep in r["reports"] for s in rep.result.sites]
    assert all(s.node.target is MLA and op_arguments(s.node, MLA.overloadpacket)["variant"].nope_dim > 0 for s in sites)


def _decode_graph_nodes(budget: int, attn: str = "sdpa"):
    """The rewritten decode graph of tiny DeepSeek-V3 (eager op chain, so op calls count)."""
    model = tiny_family("deepseek_v3", attn)
    forward = torch.compile(model.forward, backend="specontext", options={"budget": budget, "inner": "eager"})
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    logits = decode_logits(model, forward, ids, 6, cache)
    graph = next(r for r in reversed(sc.compile_reports()) if r.result.phase == "decode").result.sites[0].node.graph
    return model, cache, logits, graph


def test_mla_small_budget_reads_only_the_selected_latent_rows():
    """Budget 8 of 36 tokens: every decode site runs the MLA op over 8 selected latent rows,
    and nothing in the rewritten graph up-projects the store (``kv_b_proj`` is applied to
    the one attended row per head only, inside the op)."""
    model, cache, logits, graph = _decode_graph_nodes(8)
    assert cache.path_counts()["gather_sites"] == 2 * 6  # two layers, six decode steps
    latent = [n for n in graph.nodes if n.target is MLA]
    assert len(latent) == 2 and all(
        op_arguments(n, MLA.overloadpacket)["variant"].nope_dim == model.config.qk_nope_head_dim > 0 for n in latent)
    stores = {n for n in graph.nodes if n.op == "placeholder" and "cache_layers" in n.name
              and not n.name.endswith("cumulative_length")}
    assert len(stores) == 4  # two layers: latent and rotary key stores
    readers = {u.target for s in stores for u in s.users}  # functions, or method names (str)
    assert not readers & {torch._C._nn.linear, torch.nn.functional.linear, "expand", "view", "transpose"}, readers
    assert all(torch.isfinite(x).all() for x in logits)
    select = scorers.head_select
    selections = [n for n in graph.nodes if is_op(n, select)]
    assert len(selections) == 1 and all(  # MLA scoring, once per step
        isinstance(store, tuple) for store in op_arguments(selections[0], select)["stores"])


def test_mla_triton_kernel_equals_torch_path(triton_interpreter):
    """The kernel route (``kernel="triton"``): the generated MLA kernel (absorbed layout) runs each site and
    gives the torch path's output (Triton interpreter on CPU; small shapes)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(3)
    b, h, cap, r, p, nope, v = 1, 4, 16, 16, 4, 8, 8
    query = torch.randn(b, h, 1, nope + p, generator=g)
    latent, rope = torch.randn(b, 1, cap, r, generator=g), torch.randn(b, 1, cap, p, generator=g)
    weight = torch.randn(h * (nope + v), r, generator=g) / 4
    indices = torch.tensor([[[0, 1, 5, 9, 11, 12]]])
    q = latent_query(query, weight, nope)
    counters.clear()
    variant = AttentionVariant(0.3, nope_dim=nope)
    got = torch.ops.specontext.sparse_attention(q, latent, rope, indices, torch.tensor(13), None,
                                                StepSpec(6, 6, kernel="triton", route="kernel"), variant)
    assert counters["specontext"]["triton_attention_calls"] == counters["specontext"]["mla_attention_calls"] == 1
    want = mla_sparse_attention(q, latent, rope, indices, torch.tensor(13), None, StepSpec(6, 6), variant)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{"candidates": 2.0}, {"candidates": 2.0, "min_coverage": 0.5}],
                         ids=["two-stage", "guard"])
def test_mla_two_stage_selection_and_guard_equal_eager_at_full_budget(options, monkeypatch):
    """The per-layer refinement scores the latent rows with the layer's absorbed query; at a
    budget covering the context it keeps everything (and the guard never fires)."""
    caches = record_caches(monkeypatch)
    r = run_family("deepseek_v3", "sdpa", dense_shortcut=False, **options)
    assert r["decode_rewritten"] == 2 and r["max_err"] < 1e-4
    assert_gather_path(caches[-1], 2 * DECODE_STEPS)


@pytest.mark.slow
def test_mla_refined_small_budget_inductor_equals_eager_op_chain():
    """Two-stage selection at budget 8 of 36: the lowered (inductor) step gives the logits
    of the eager op chain (same code, same numbers)."""
    runs = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        model = tiny_family("deepseek_v3", "sdpa")
        forward = torch.compile(model.forward, backend="specontext",
                                options={"budget": 8, "candidates": 2.0, "inner": inner})
        cache = sc.SpeContextCache(model.config, max_cache_len=64)
        ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
        runs[inner] = decode_logits(model, forward, ids, 5, cache)
        assert cache.path_counts()["gather_sites"] == 2 * 5
    for a, b in zip(runs["eager"], runs["inductor"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _traced_graph():
    """Dynamo's decode graph of tiny DeepSeek-V3 with a SpeContextCache (before any pass)."""
    model = tiny_family("deepseek_v3", "sdpa")
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=keep)
    cache = sc.SpeContextCache(model.config, max_cache_len=32)
    with torch.no_grad():
        ids = torch.randint(0, 128, (1, 10))
        forward(input_ids=ids, cache=cache, use_cache=True)
        forward(input_ids=ids[:, :1], cache=cache, use_cache=True)
    return graphs[-1]


def _mutate(gm, edit) -> list:
    graph = copy.deepcopy(gm).graph
    edit(graph)
    return find_attention_sites(graph)


def test_mla_near_misses_are_not_rewritten():
    """The matcher checks every constant of ``expand_kv``: a copy into the wrong slice, a
    split that does not match the projection, or a biased up-projection keep the site dense
    with a reason (the whole-store up-projection then stays, exact)."""
    gm = _traced_graph()
    assert [s.mla is not None and s.reason is None for s in find_attention_sites(gm.graph)] == [True, True]

    def wrong_slice(graph):
        for n in graph.nodes:
            if n.target is __import__("operator").getitem and n.args[1:] == ((Ellipsis, slice(None, 16, None)),):
                n.args = (n.args[0], (Ellipsis, slice(None, 15, None)))

    def wrong_split(graph):
        for n in graph.nodes:
            if n.op == "call_function" and n.target is torch.functional.split and n.args[1] == [16, 16]:
                n.args = (n.args[0], [15, 17])

    def biased(graph):
        for n in graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.linear and "kv_b_proj" in str(n.args[1]):
                n.args = (n.args[0], n.args[1], n.args[1])

    for edit in (wrong_slice, wrong_split, biased):
        sites = _mutate(gm, edit)
        assert all(s.mla is None and s.reason and "computed from the KV store" in s.reason for s in sites), \
            (edit.__name__, [(s.mla, s.reason) for s in sites])
