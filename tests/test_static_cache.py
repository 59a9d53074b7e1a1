"""Hugging Face's StaticCache adopted as a KV store (passes/static_cache.py, issue 13).

The recipe a Hugging Face user already writes — ``model.forward = torch.compile(
model.forward, backend="specontext", options=...)`` or ``generate(...,
compile_config=CompileConfig(backend="specontext", ...))`` with
``cache_implementation="static"`` — runs sparse with no specontext-specific call. Checked:
tokens equal eager at full budget on the gather path (dense shortcut off, counters
asserted), the same logits as ``SpeContextCache`` at a small budget (one selection code),
and the pattern match refuses every near miss.
"""

import logging
import operator

import pytest
import torch
from specontext_compile.passes.static_cache import adopt_static_cache, has_static_cache_writes
from specontext_compile.runtime.static_state import path_counts
from test_backend_e2e import decode_logits
from torch import fx
from transformers import CompileConfig, DynamicCache, StaticCache

import specontext_compile as sc
from specontext_compile import backend
from specontext_compile.tiny_models import tiny_family

# fp32 gather path vs eager SDPA: max |logit diff| observed ~1e-7 (see test_backend_e2e)
ATOL = 1e-4
FULL = {"budget": 64, "dense_shortcut": False}
SMALL = {"budget": 12, "recent_window": 3, "sink_tokens": 2}


@pytest.fixture
def model():
    return tiny_family("llama", "sdpa")


def _prompt(batch=1, length=40, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _steps(forward, cache, ids, steps):
    """Prefill + teacher-forced greedy decode; the last-token logits of every call."""
    return torch.stack(decode_logits(None, forward, ids, steps, cache))


def _assert_gathered(model, steps, sites):
    counts = path_counts(model)
    assert counts["decode_steps"] == steps, counts
    assert counts["gather_sites"] == counts["sparse_sites"] == steps * sites, counts
    assert counts["dense_store_sites"] == 0, counts


def test_forward_recipe_generate_static_equals_eager_on_the_gather_path(model):
    ids = _prompt()
    kw = {"max_new_tokens": 8, "do_sample": False, "cache_implementation": "static"}
    want = model.generate(ids, **kw)
    model.forward = torch.compile(model.forward, backend="specontext", options=FULL)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    _assert_gathered(model, steps=7, sites=2)  # 8 new tokens: prefill + 7 decode steps


def test_compile_config_recipe_runs_sparse(model):
    ids = _prompt(seed=1)
    kw = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    want = model.generate(ids, **kw)
    config = CompileConfig(backend="specontext", mode=None, options=FULL)
    config._compile_all_devices = True  # Hugging Face auto-compiles on CUDA only, unless asked
    got = model.generate(ids, compile_config=config, **kw)
    assert torch.equal(got, want)
    _assert_gathered(model, steps=5, sites=2)


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_small_budget_equals_specontext_cache(model, inner):
    """Same options, same selection code: StaticCache and SpeContextCache give the same
    logits at budget 12 of a 40-token context, batch of 2 (page_rescue=0: Hugging Face's
    StaticCache keeps no page bounds, so only our cache could rescue pages)."""
    ids = _prompt(batch=2, seed=2)
    opts = dict(SMALL, inner=inner, page_rescue=0)
    hf_cache = StaticCache(config=model.config, max_cache_len=56)
    static = _steps(torch.compile(model.forward, backend="specontext", options=opts), hf_cache, ids, steps=6)
    assert path_counts(hf_cache)["gather_sites"] == 12  # the StaticCache's own steps
    ours = sc.SpeContextCache(model.config, max_cache_len=56)
    reference = _steps(torch.compile(model.forward, backend="specontext", options=opts), ours, ids, steps=6)
    assert ours.path_counts()["gather_sites"] == 12
    assert path_counts(ours) == ours.path_counts()
    _assert_gathered(model, steps=12, sites=2)  # the model counts both caches' steps
    torch.testing.assert_close(static, reference, atol=1e-5, rtol=1e-5)
    dense = _steps(model.forward, StaticCache(config=model.config, max_cache_len=56), ids, steps=6)
    assert (static - dense).abs().max() > 1e-3  # the budget really sparsified


def test_dynamic_cache_warns_once_naming_both_ways(model, caplog, monkeypatch):
    monkeypatch.setattr(backend, "_DENSE_CACHE_WARNED", False)
    forward = torch.compile(model.forward, backend="specontext", options=SMALL)
    with caplog.at_level(logging.WARNING, logger="specontext_compile.backend"):
        _steps(forward, DynamicCache(config=model.config), _prompt(), steps=2)
        _steps(forward, DynamicCache(config=model.config), _prompt(batch=2), steps=1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "DynamicCache" in r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert 'cache_implementation="static"' in text and "SpeContextCache" in text
    assert path_counts(model)["sparse_sites"] == 0


def test_offload_with_static_cache_stays_dense_with_a_reason(model, caplog):
    forward = torch.compile(model.forward, backend="specontext", options=dict(SMALL, device_memory_bytes=1 << 40))
    with caplog.at_level(logging.WARNING, logger="specontext_compile.backend"):
        got = _steps(forward, StaticCache(config=model.config, max_cache_len=56), _prompt(), steps=2)
    want = _steps(model.forward, StaticCache(config=model.config, max_cache_len=56), _prompt(), steps=2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert any("needs specontext_compile.SpeContextCache" in r.getMessage() for r in caplog.records)


# --- the pattern match, on hand-built graphs -------------------------------------------

def _layer_graph(dim=2, q=1, advance=1, same_index=True, read_between=False):
    """A graph spelled as dynamo records StaticLayer.update (arange + length, length.add_,
    two index_copy_), then attention over the store; each argument changes one detail."""
    graph = fx.Graph()
    keys, values, length, k, v, query = (graph.placeholder(n) for n in ("keys", "values", "length", "k", "v", "q"))
    pos = graph.call_function(operator.add, (graph.call_function(torch.arange, (q,)), length))
    graph.call_method("add_", (length, advance))
    if read_between:
        query = graph.call_function(operator.add, (query, graph.call_method("float", (length,))))
    graph.call_method("index_copy_", (keys, dim, pos, k))
    other = pos if same_index else graph.call_function(operator.add, (graph.call_function(torch.arange, (q,)), length))
    graph.call_method("index_copy_", (values, dim, other, v))
    graph.output(graph.call_function(torch.nn.functional.scaled_dot_product_attention, (query, keys, values)))
    shapes = [(1, 2, 8, 4), (1, 2, 8, 4), (), (1, 2, q, 4), (1, 2, q, 4), (1, 2, q, 4)]
    for node, shape in zip([n for n in graph.nodes if n.op == "placeholder"], shapes):
        node.meta["example_value"] = torch.zeros(shape, dtype=torch.long if shape == () else torch.float32)
    return fx.GraphModule(torch.nn.Module(), graph)


def _hf_update(keys, values, length, k, v, query):
    """What the graph computes, written as transformers' StaticLayer.update does it."""
    pos = torch.arange(k.shape[-2]) + length
    length.add_(k.shape[-2])
    keys.index_copy_(2, pos, k)
    values.index_copy_(2, pos, v)
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values)


@pytest.mark.parametrize("change", [{"dim": 1}, {"advance": 2}, {"same_index": False}, {"read_between": True}],
                         ids=["copy-dim-1", "advance-differs", "value-index-differs", "length-read-between"])
def test_near_misses_are_not_adopted(change):
    """Each differs from StaticLayer.update in one place where kv_write would not compute
    the same thing: the graph is left exactly as it was."""
    gm = _layer_graph(**change)
    before = gm.code
    assert not has_static_cache_writes(gm.graph)
    assert adopt_static_cache(gm, [torch.nn.Parameter(torch.zeros(1))]) is None
    assert gm.code == before


def test_the_exact_pattern_is_adopted_and_computes_the_same():
    gm = _layer_graph()
    assert has_static_cache_writes(gm.graph)
    owner = torch.nn.Parameter(torch.zeros(1))
    result = adopt_static_cache(gm, [owner])
    assert result.writes == 1 and result.state is not None
    assert not any(n.op == "call_method" and n.target in ("index_copy_", "add_") for n in gm.graph.nodes)
    gm.recompile()
    g = torch.Generator().manual_seed(0)
    args = [torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), torch.tensor(3)] + [
        torch.randn(1, 2, 1, 4, generator=g) for _ in range(3)]
    ref_args = [a.clone() for a in args]
    got = gm(*[a.clone() if i > 2 else a for i, a in enumerate(args)], *result.state.tensors())
    want = _hf_update(*ref_args)
    torch.testing.assert_close(got, want)
    for i in range(3):  # the stores and the length end up as HF's update leaves them
        torch.testing.assert_close(args[i], ref_args[i])


def test_no_write_pattern_means_untouched():
    gm = _layer_graph()
    for node in [n for n in gm.graph.nodes if n.op == "call_method"]:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    assert adopt_static_cache(gm, [torch.nn.Parameter(torch.zeros(1))]) is None


def test_a_new_prompt_never_selects_with_the_previous_requests_query(model):
    """Hugging Face's CompileConfig path runs the prefill eagerly, so no query is recorded
    for a new prompt: its first decode step must not use the previous request's lagged
    query (stamped with another length), but select by recency, exactly as on a model that
    never ran request A. Logits of every step compared, budget 12 of a 40-token prompt."""
    import copy

    fresh_model = copy.deepcopy(model)
    config = CompileConfig(backend="specontext", mode=None, options=SMALL)
    config._compile_all_devices = True
    kw = {"max_new_tokens": 5, "do_sample": False, "cache_implementation": "static", "compile_config": config,
              "return_dict_in_generate": True, "output_logits": True}
    prompt_a, prompt_b = _prompt(seed=3), _prompt(seed=4)
    model.generate(prompt_a, **kw)
    after_a = torch.stack(model.generate(prompt_b, **kw).logits)
    alone = torch.stack(fresh_model.generate(prompt_b, **kw).logits)
    assert path_counts(model)["decode_steps"] == 8 and path_counts(fresh_model)["decode_steps"] == 4
    torch.testing.assert_close(after_a, alone, atol=1e-5, rtol=1e-5)


# --- sizes dynamo makes symbolic (issue 52): a second batch size ------------------------

def _generate_logits(model, ids, **kw):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static",
                             return_dict_in_generate=True, output_logits=True, **kw)
    return torch.stack(out.logits, 1)  # [batch, steps, vocab]


def _symbolic_batch_decode_graphs() -> int:
    """Decode graphs adopted with a batch dynamo made symbolic (the state input's batch)."""
    found = 0
    for report in backend.compile_reports():
        state = next((n for n in report.graph_module.graph.nodes if n.name == "specontext_query_state"), None)
        if report.result.phase == "decode" and state is not None:
            found += isinstance(state.meta["example_value"].shape[1], torch.SymInt)
    return found


@pytest.mark.parametrize("way", ["forward", "compile_config"])
def test_a_second_batch_size_runs_sparse_and_each_row_decodes_as_alone(model, way):
    """The README's first way (and Hugging Face's own compile path) at batch 1, then 2, then
    3: dynamo makes the batch symbolic at the second size, and the adopted StaticCache's
    state is sized from each call's real inputs. Every row of every call gives the logits of
    its prompt run alone at batch 1 (no padding, one selection per row: fp32, 1e-5) at
    budget 12 of a 40-token prompt, on the gather path (counters), and differs from dense."""
    prompts = _prompt(batch=3, seed=7)
    backend.clear_compile_reports()
    if way == "forward":
        model.forward = torch.compile(model.forward, backend="specontext", options=SMALL)
        kw = {}
    else:
        config = CompileConfig(backend="specontext", mode=None, options=SMALL)
        config._compile_all_devices = True
        kw = {"compile_config": config}
    alone = torch.cat([_generate_logits(model, prompts[i:i + 1], **kw) for i in range(3)])
    steps = alone.shape[1]
    for batch in (2, 3, 1):
        before = path_counts(model)
        got = _generate_logits(model, prompts[:batch], **kw)
        torch.testing.assert_close(got, alone[:batch], atol=1e-5, rtol=1e-5)
        after = path_counts(model)
        assert after["decode_steps"] - before["decode_steps"] == steps - 1  # the first token is the prefill's
        assert after["gather_sites"] - before["gather_sites"] == 2 * (steps - 1)  # 2 layers, every step gathered
        assert after["dense_store_sites"] == 0
    assert _symbolic_batch_decode_graphs() >= 1  # the class at stake: a batch-symbolic graph ran
    dense = torch.cat([_generate_logits(tiny_family("llama", "sdpa"), prompts[i:i + 1]) for i in range(3)])
    assert (alone - dense).abs().max() > 1e-3  # the budget really sparsified
