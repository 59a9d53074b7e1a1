"""The selection's int8 copy of the retrieval layers' keys (option ``selection_keys="int8"``,
runtime/key_mirror.py): each write stores exactly ``int8_keys.quantize_rows`` of its keys, the
rows follow the stores through the cache's operations, and the compiled step scores them
(counters) with the logits of a step that scores the stores' keys rounded the same way."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime import cpu_selection, int8_keys, key_mirror
from specontext_compile.runtime.torch_private import counters
from test_backend_e2e import decode_logits

import specontext_compile as sc

pytestmark = pytest.mark.skipif(not cpu_selection.available(), reason="no C++ compiler to build the CPU kernel")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), num_kv=st.integers(1, 3), capacity=st.integers(2, 300),
       d=st.sampled_from([8, 64, 72]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data=st.data())
def test_write_rows_stores_exactly_the_written_keys_rows(seed, b, num_kv, capacity, d, dtype, data):
    """After a write of ``q_len`` keys ending at ``length`` into the store, their positions hold
    exactly ``quantize_rows``' levels and scales of the keys as stored; every other position
    keeps what it held (zero rows and rows of one large entry included)."""
    gen = torch.Generator().manual_seed(seed)
    q_len = data.draw(st.integers(1, capacity))
    end = data.draw(st.integers(q_len, capacity))
    key = (torch.randn(b, num_kv, q_len, d, generator=gen) * 10.0 ** data.draw(st.integers(-3, 3))).to(dtype)
    key[:, :, ::7] = 0
    key[:, :, 1::5, 0] = 1e4
    levels = torch.full((b, num_kv, capacity, d), 99, dtype=torch.int8)
    scales = torch.full((b, num_kv, capacity), -1.0)
    start = end - q_len
    key_cache = torch.randn(b, num_kv, capacity, d, generator=gen).to(dtype)
    key_cache[:, :, start:end] = key
    key_mirror.write_rows(key_cache, [levels, scales], torch.tensor(end), key)
    want_levels, want_scales = int8_keys.quantize_rows(key)
    assert torch.equal(levels[:, :, start:end], want_levels) and torch.equal(scales[:, :, start:end], want_scales)
    assert (levels[:, :, :start] == 99).all() and (levels[:, :, end:] == 99).all()
    assert (scales[:, :, :start] == -1).all() and (scales[:, :, end:] == -1).all()


def _prefilled(selection_keys="int8", tokens=30, **cache_options):
    model = tiny_llama()
    cache = sc.SpeContextCache(model.config, max_cache_len=64, selection_keys=selection_keys, **cache_options)
    ids = torch.randint(0, 128, (2, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return model, cache


def _assert_current(layer):
    """The layer's int8 rows are those of its written keys (positions < its length)."""
    n = int(layer.cumulative_length)
    levels, scales = int8_keys.quantize_rows(layer.keys[:, :, :n])
    assert torch.equal(layer.key_levels[:, :, :n], levels) and torch.equal(layer.key_scales[:, :, :n], scales)


def test_the_retrieval_layers_stores_keep_their_keys_int8_rows_through_cache_ops():
    """``selection_keys="int8"``: exactly the retrieval layers' stores (the option's layers,
    negative counting from the end) keep ``key_levels`` ``[batch, kv_heads, capacity,
    head_dim]`` int8 and ``key_scales``, equal to the rows of their written keys after a
    prefill, a crop and a rewrite, a reorder, an eager growth and a batch change; ``"store"``
    keeps none; a bad value is refused, naming the choices."""
    model, plain = _prefilled("store")
    assert all(layer.key_levels is None for layer in plain.kv_layers)
    _, cache = _prefilled(retrieval_layers=(0, -1))
    mirrored = [i for i, layer in enumerate(cache.kv_layers) if layer.key_levels is not None]
    assert mirrored == [0, model.config.num_hidden_layers - 1]
    layer = cache.kv_layers[0]
    assert layer.key_levels.dtype == torch.int8 and layer.key_levels.shape == layer.keys.shape
    assert layer.key_scales.shape == layer.keys.shape[:3]
    _assert_current(layer)
    cache.crop(-5)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 3)), cache=cache, use_cache=True)
    _assert_current(layer)
    cache.reorder_cache(torch.tensor([1, 0]))
    _assert_current(layer)
    cache.batch_repeat_interleave(2)
    _assert_current(layer)
    assert layer.key_levels.shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 3]))
    _assert_current(layer)
    with pytest.raises(ValueError, match="selection_keys must be one of"):
        sc.SpeContextCache(model.config, selection_keys="int4")
    with pytest.raises(ValueError, match="'selection_keys' must be one of"):
        sc.SpeContextConfig.from_options({"selection_keys": "fp8"})


def test_an_eager_cache_grows_its_int8_rows_with_its_stores():
    """A cache sized by its first write grows by chunks in eager mode: the int8 rows grow with
    the store and keep the rows written before."""
    model = tiny_llama()
    cache = sc.SpeContextCache(model.config, chunk_tokens=16, selection_keys="int8", retrieval_layers=0)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 10)), cache=cache, use_cache=True)
        first = cache.kv_layers[0].keys.shape[2]
        model(input_ids=torch.randint(0, 128, (1, 30)), cache=cache, use_cache=True)
    layer = cache.kv_layers[0]
    assert layer.keys.shape[2] > first and layer.key_levels.shape == layer.keys.shape
    _assert_current(layer)


def _round_trip_scores(query_state, stores, cached, visible, variant):
    """The float kernel over the stores' keys rounded as the mirror rounds them, and the query as
    the int8 entry rounds it."""
    query = int8_keys.round_trip((query_state[: len(stores)].float() * variant.scale).to(stores[0].dtype).float())
    rounded = [int8_keys.round_trip(s) for s in stores]
    return torch.ops.specontext.cpu_selection_scores(query, rounded, cached, None if visible is None else visible[:, 0])


def test_the_compiled_step_scores_the_mirror_with_the_logits_of_the_rounded_keys(monkeypatch):
    """The default options' step with ``selection_keys="int8"``, compiled by inductor on CPU:
    each decode step scores the cache's int8 keys (every selection call through the int8
    entry: one a step), the retrieval layers' int8 rows are those of their written keys after
    the last step, and the logits equal those of the same step whose selection scores the
    stores' keys rounded to int8 and back (the float kernel, patched in; the compile caches off
    for it)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    options = {"budget": 8, "page_rescue": 16, "selection_keys": "int8"}

    def run():
        compiled = torch.compile(model.forward, backend="specontext", options=options)
        cache = sc.SpeContextCache(model.config, max_cache_len=64, selection_keys="int8")
        return decode_logits(model, compiled, ids, 4, cache), cache

    names = ("cpu_kernel_selection_int8_calls", "cpu_kernel_selection_calls")
    before = [counters["specontext"][n] for n in names]
    applied = counters["specontext"]["selection_keys_int8"]
    got, cache = run()
    assert counters["specontext"]["selection_keys_int8"] > applied
    calls = [counters["specontext"][n] - b for n, b in zip(names, before)]
    assert calls == [4, 4]  # every selection call of the 4 decode steps took the int8 entry
    for layer in cache.kv_layers:  # every written row of the retrieval layers' keys, after the last step
        if layer.key_levels is not None:
            _assert_current(layer)
    assert sum(layer.key_levels is not None for layer in cache.kv_layers) == min(8, model.config.num_hidden_layers)
    torch._dynamo.reset()
    monkeypatch.setattr(cpu_selection, "lagged_scores",
                        lambda query_state, stores, cached, visible, variant, mirrors=None:
                        _round_trip_scores(query_state, stores, cached, visible, variant))
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        want, _ = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_without_the_cache_s_mirror_the_option_falls_back_to_the_stores_logged(caplog):
    """``selection_keys="int8"`` with a cache created without it: the selection scores the
    stores (the float kernel), the reason logged naming the fix, the logits those of the
    default option."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def run(selection_keys):
        compiled = torch.compile(model.forward, backend="specontext",
                                 options={"budget": 8, "page_rescue": 16, "selection_keys": selection_keys})
        return decode_logits(model, compiled, ids, 2, sc.SpeContextCache(model.config, max_cache_len=64))

    fallbacks = counters["specontext"]["selection_keys_fallback"]
    with caplog.at_level("INFO", logger="specontext_compile.passes.head_lagged"):
        got = run("int8")
    assert counters["specontext"]["selection_keys_fallback"] > fallbacks
    assert "selection_keys='int8'" in caplog.text and "create the cache with SpeContextCache" in caplog.text
    torch._dynamo.reset()
    want = run("store")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_compiled_write_past_the_capacity_is_the_clear_error_with_int8_rows():
    """With the int8 rows, a compiled step's write past ``max_cache_len`` is still the cache's
    clear error, raised before any row is written (the rows' write waits for the capacity
    check, as the store's does; before, layer 0's int8 rows were written first, out of range,
    and inductor's bounds check aborted the process)."""
    model = tiny_llama(layers=1)
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8, "selection_keys": "int8"})
    cache = sc.SpeContextCache(model.config, max_cache_len=16, chunk_tokens=8, selection_keys="int8")
    ids = torch.randint(0, 128, (1, 15))
    with torch.no_grad():
        compiled(input_ids=ids, cache=cache, use_cache=True)
        compiled(input_ids=ids[:, :1], cache=cache, use_cache=True)
        with pytest.raises(Exception, match="max_cache_len"):
            compiled(input_ids=ids[:, :1], cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.key_levels is not None and int(layer.cumulative_length) == 16
    _assert_current(layer)


def test_a_compiled_bfloat16_step_writes_the_rows_of_the_keys_as_stored():
    """In a compiled bfloat16 step the int8 rows written at decode are ``quantize_rows`` of the
    stored (bfloat16-rounded) keys: read back from the store, not taken from the value inductor
    computed before rounding it (that differed by a level in some rows before)."""
    model = tiny_llama(layers=2).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8, "page_rescue": 0})
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    calls = counters["specontext"]["cpu_kernel_selection_int8_calls"]
    decode_logits(model, compiled, ids, 6, cache)
    assert counters["specontext"]["cpu_kernel_selection_int8_calls"] - calls == 6  # the default: int8 rows scored
    assert all(layer.key_levels is not None for layer in cache.kv_layers)
    for layer in cache.kv_layers:
        _assert_current(layer)
