"""The sympy memory model: paper equations, hand-computed plans, real allocations."""

import math

import pytest
import sympy
import torch

import specontext_compile as sc
from specontext_compile.runtime.memory_model import DeviceMemoryError, MemoryModel
from specontext_compile.runtime.offload import enable_offload
from _tiny import tiny_llama

# L=4 layers, 2 KV heads, head_dim 8 (K and V), fp16, 1 request, budget 16, 1000 B weights:
# one token of one layer = 1 x 2 x (8 + 8) x 2 = 64 B, and
#   M_part(S, i) = 1.3 x 1000 + 64 [(4 - i) S + 16 i]  bytes
SMALL = dict(num_layers=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, elem_bytes=2, batch=1,
             budget=16, weight_bytes=1000)


def test_expression_is_the_papers_equation_for_fp16():
    """eq. 7 with 4 = 2 (K,V) x 2 bytes, the DLM's "+1" layer and alpha, symbolically."""
    mm = MemoryModel(**dict(SMALL, draft_weight_bytes=200, draft_cache_layers=1, alpha=0.5))
    expr, s, lc = mm.expression()
    L, R, H, D, B = 4, 1, 2, 8, 16
    paper = (sympy.Rational(13, 10) * (1000 + 200)
             + 4 * R * (((L - lc) + 1 + sympy.Rational(1, 2)) * s + lc * B) * H * D)
    assert sympy.simplify(expr - paper) == 0


def test_offload_none_when_everything_fits():
    mem = 1300 + 64 * 4 * 1000  # all 4 layers hold 1000 tokens exactly
    mm = MemoryModel(**SMALL)
    st = mm.thresholds(mem)
    assert st[0] == 1001  # 1000 tokens fit, 1001 do not
    assert mm.plan(1000, 0, st) == 0
    assert mm.device_bytes(1000, 0) == mem


def test_offload_one_then_two_as_the_output_grows():
    mem = 1300 + 64 * 4 * 1000
    mm = MemoryModel(**SMALL)
    st = mm.thresholds(mem)
    # one offloaded: 1300 + 64 (3 S + 16) <= mem  <=>  S <= (4000 - 16) / 3 = 1328
    assert st[1] == 1329
    assert mm.plan(1001, 0, st) == 1
    assert mm.plan(1328, 1, st) == 1
    assert mm.plan(1329, 1, st) == 2  # the plan only grows, one layer at a time


def test_offload_all_and_error_when_even_that_does_not_fit():
    mem = 1300 + 64 * 4 * 16  # exactly four 16-row buffers
    mm = MemoryModel(**SMALL)
    st = mm.thresholds(mem)
    # i offloaded: (4 - i) S + 16 i <= 64  <=>  S <= 16 for i < 4; i = 4 needs no S
    assert st == [17, 17, 17, 17, math.inf]
    assert mm.plan(16, 0, st) == 0
    assert mm.plan(17, 0, st) == 4
    assert mm.plan(10**6, 4, st) == 4
    tight = MemoryModel(**SMALL)
    st = tight.thresholds(mem - 1)
    assert st[4] == 0
    with pytest.raises(DeviceMemoryError, match="device_memory_bytes"):
        tight.plan(17, 0, st)


def test_gqa_batch_and_element_size_enter_the_row_size():
    mm = MemoryModel(**dict(SMALL, batch=3, elem_bytes=4, num_kv_heads=5, head_dim_v=4))
    assert mm.row_bytes == 3 * 5 * (8 + 4) * 4


@pytest.mark.parametrize("offload_all", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_prediction_matches_real_allocations_within_5_percent(offload_all):
    model = tiny_llama(layers=3)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = sc.SpeContextCache(model.config, max_cache_len=100, chunk_tokens=50)
    manager = enable_offload(cache, model, 1 << 40, budget=16)
    forward = torch.compile(model.forward, backend="specontext",
                            options={"budget": 16, "page_rescue": 0, "device_memory_bytes": 1 << 40})
    with torch.no_grad():
        forward(input_ids=ids, cache=cache, use_cache=True)
        mm = manager.prepare()
        if offload_all:
            manager.prepare(mm.device_bytes(41, 3))
        forward(input_ids=ids[:, :1], cache=cache, use_cache=True)
    n = len(manager.offloaded)
    assert n == (3 if offload_all else 0)
    capacity = cache.layers[0].keys.shape[2]
    bounds = sum(t.nbytes for layer in cache.kv_layers for t in (layer.page_min, layer.page_max))
    assert bounds > 0  # the default cache keeps page bounds, on the device even when offloaded
    real = (cache.kv_bytes + bounds + sum(b.nbytes for b in manager.buffers.values())
            + cache.query_state.numel() * cache.query_state.element_size()
            + cache.query_valid.numel() * cache.query_valid.element_size()
            + manager.selection.numel() * manager.selection.element_size())
    predicted = mm.allocated_bytes(capacity, n)
    assert abs(predicted - real) <= 0.05 * real, (predicted, real)


def test_page_bounds_are_counted_exactly_in_the_fixed_part():
    """Every layer's page bounds (min and max keys per 16-token page, kept on the device even
    when the layer is offloaded) are in the manager's fixed bytes: page_bound_bytes equals
    the real bound tensors of a default cache, and the up-front minimum with page_tokens=0
    is smaller by exactly that."""
    from specontext_compile.runtime.offload import minimum_device_bytes, page_bound_bytes

    model = tiny_llama()
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 40)), cache=cache, use_cache=True)
    capacity = cache.layers[0].keys.shape[2]
    real = sum(t.nbytes for layer in cache.kv_layers for t in (layer.page_min, layer.page_max))
    want = page_bound_bytes(cfg.num_hidden_layers, 2, kv_heads, head_dim, 4, capacity, 16)
    assert real == want == cfg.num_hidden_layers * 2 * 2 * kv_heads * head_dim * 4 * -(-(capacity + 15) // 16)
    assert page_bound_bytes(cfg.num_hidden_layers, 2, kv_heads, head_dim, 4, capacity, 0) == 0
    with_bounds = minimum_device_bytes(model, 16, tokens=40, batch=2, capacity=capacity)
    assert with_bounds - minimum_device_bytes(model, 16, tokens=40, batch=2, page_tokens=0) == want


# --- degenerate plans (issue 15: memory too small is a clear error, not a crash) ----------

def test_nothing_fits_when_the_fixed_part_alone_is_too_big():
    """1.3 x weights > memory: every threshold is 0 (the old sympy.solve found no root
    S >= 0 and crashed); the plan refuses with the minimum that would work."""
    mm = MemoryModel(**SMALL)
    st = mm.thresholds(1299)
    assert st == [0, 0, 0, 0, 0]
    with pytest.raises(DeviceMemoryError, match=r"at least 5396 bytes") as err:
        mm.plan(0, 0, st)
    assert isinstance(err.value, ValueError)  # a bad option value, catchable as such
    assert mm.minimum_device_bytes(0) == 1300 + 64 * 16 * 4


def test_everything_fits_forever_without_a_cache_term():
    """A model whose device bytes do not grow with S once all layers are offloaded: the
    last threshold is inf, and a memory that holds the whole model never offloads."""
    mm = MemoryModel(**SMALL)
    st = mm.thresholds(10**12)
    assert st[-1] == math.inf and st[0] > 10**9
    assert mm.plan(10**6, 0, st) == 0


@pytest.mark.parametrize("layers_off", [0, 1, 3])
@pytest.mark.parametrize("tokens", [0, 1, 500])
def test_exactly_at_a_threshold(layers_off, tokens):
    """Memory equal to the predicted bytes at (tokens, layers_off): that length still fits
    (ST = tokens + 1), one byte less and it does not (ST <= tokens)."""
    mm = MemoryModel(**SMALL)
    mem = mm.device_bytes(tokens, layers_off)
    assert mm.thresholds(mem)[layers_off] == tokens + 1
    assert mm.thresholds(mem - 1)[layers_off] <= tokens


def test_compile_refuses_a_tier_below_the_fixed_part_before_compiling():
    """sc.compile(model, device_memory_bytes=weights + a little): refused up front with the
    minimum; the model is left as it was. At exactly the minimum it is accepted."""
    from specontext_compile.runtime.offload import minimum_device_bytes, model_weight_bytes

    model = tiny_llama()
    forward = model.forward
    need = minimum_device_bytes(model, 16)
    assert need > 1.3 * model_weight_bytes(model)
    with pytest.raises(DeviceMemoryError, match=f"device_memory_bytes >= {need}"):
        sc.compile(model, budget=16, page_rescue=0, device_memory_bytes=model_weight_bytes(model) + 1024)
    assert model.forward == forward and not hasattr(model, "_specontext_options")
    sc.compile(model, budget=16, page_rescue=0, device_memory_bytes=need)
    sc.api.restore(model)


def test_a_tier_too_small_without_the_model_is_refused_at_prepare_with_the_minimum():
    """enable_offload without the model (weights unknown) cannot check up front; the plan,
    made once the stores exist, refuses with the minimum instead of a crash."""
    model = tiny_llama()
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 40)), cache=cache, use_cache=True)
    manager = enable_offload(cache, None, 1000, 16)
    with pytest.raises(DeviceMemoryError, match="cannot hold 40 tokens even with all 3 layers offloaded: it "
                                                r"needs at least \d+ bytes"):
        manager.prepare()


def test_the_up_front_minimum_is_the_managers_own_prediction():
    """minimum_device_bytes (from the config, before any cache exists) equals what the
    manager's memory model predicts once the stores exist, so the refusal names exactly
    the least tier that works: at that size the prompt fits fully offloaded, one byte less
    it is refused up front (the stores exist, so the check counts the page bounds of their
    real capacity, 64 here)."""
    from specontext_compile.runtime.offload import minimum_device_bytes

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    need = minimum_device_bytes(model, 16, tokens=40, capacity=64)
    for memory, fits in ((need, True), (need - 1, False)):
        cache = sc.SpeContextCache(model.config, max_cache_len=64)
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        if fits:
            assert enable_offload(cache, model, memory, 16).prepare().minimum_device_bytes(40) == need
        else:
            with pytest.raises(DeviceMemoryError, match=f"device_memory_bytes >= {need}"):
                enable_offload(cache, model, memory, 16)


def test_auto_takes_free_device_memory_when_the_plan_is_made(monkeypatch):
    """device_memory_bytes="auto": free memory (plus the resident weights) read when the
    plan is made; a small free memory makes the plan offload, a large one does not."""
    from specontext_compile.runtime import offload
    from specontext_compile.runtime.offload import minimum_device_bytes, model_weight_bytes

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    assert offload.free_device_bytes(torch.device("cpu")) > 0
    assert sc.SpeContextConfig(device_memory_bytes="auto").device_memory_bytes == "auto"
    with pytest.raises(ValueError, match="'auto'"):
        sc.SpeContextConfig(device_memory_bytes="all")
    tight = minimum_device_bytes(model, 16, tokens=40, capacity=64) + 100  # fully offloaded fits, resident not
    for free, offloaded in ((tight - model_weight_bytes(model), True), (1 << 40, False)):
        monkeypatch.setattr(offload, "free_device_bytes", lambda device, free=free: free)
        cache = sc.SpeContextCache(model.config, max_cache_len=64)
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        manager = enable_offload(cache, model, "auto", 16)
        mm = manager.prepare()
        assert manager.device_memory_bytes == free + model_weight_bytes(model)
        assert (mm.plan(41, 0, manager.thresholds) > 0) == offloaded


def test_resident_layers_are_never_offloaded_and_keep_their_rows():
    """resident_layers=1 (option dense_layers): at most 3 of 4 layers go, and with all 3 gone
    the resident layer still grows: 1300 + 64 (S + 3 x 16) <= mem  <=>  S <= 4000 - 48."""
    mem = 1300 + 64 * 4 * 1000
    mm = MemoryModel(**dict(SMALL, resident_layers=1))
    st = mm.thresholds(mem)
    assert len(st) == 4 and st[:2] == MemoryModel(**SMALL).thresholds(mem)[:2]
    assert st[3] == 3953 and mm.offloadable == 3
    assert mm.plan(3952, 0, st) == 3
    with pytest.raises(DeviceMemoryError, match="3 offloadable layers offloaded \\(1 kept on the device by dense_layers"):
        mm.plan(3953, 3, st)
    assert mm.minimum_device_bytes(100) == 1300 + 64 * (100 + 3 * 16)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="resident_layers"):
            MemoryModel(**dict(SMALL, resident_layers=bad))
