"""Tokens read back from vLLM's paged CPU cache equal what vLLM's writer stored, for every
in-block layout this machine's vLLM can write (vector and AMX paths, fp32 and bf16)."""

import dataclasses

import pytest
import torch
from vllm import _custom_ops as ops

from specontext_vllm.layout import probe_layout

ISAS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32)]
if torch.cpu._is_amx_tile_supported():
    ISAS.append(("amx", torch.bfloat16))


def _written(isa, dtype, block, seed, num_kv=3, d=64, n=150):
    gen = torch.Generator().manual_seed(seed)
    blocks = 2 + n // block
    cache = torch.zeros(blocks + 3, num_kv, block, 2 * d, dtype=dtype)
    key_area, value_area = cache.view(blocks + 3, num_kv, 2 * block, d).chunk(2, dim=2)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].view(1, -1)  # scattered blocks
    keys = torch.randn(n, num_kv, d, generator=gen).to(dtype)
    values = torch.randn(n, num_kv, d, generator=gen).to(dtype)
    slots = table[0, torch.arange(n) // block] * block + torch.arange(n) % block
    ops.cpu_attn_reshape_and_cache(keys, values, key_area, value_area, slots, isa)
    return cache, table, keys.transpose(0, 1)[None], values.transpose(0, 1)[None]


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_gathered_tokens_equal_the_written_ones(isa, dtype, block, seed):
    cache, table, keys, values = _written(isa, dtype, block, seed)
    layout = probe_layout(isa, dtype, block, 64)
    assert layout.key_form is not None and layout.value_form is not None  # the fast path, not elements
    positions = torch.randint(0, keys.shape[2], (1, 3, 40), generator=torch.Generator().manual_seed(seed))
    got_k, got_v = layout.gather(cache, table, positions)
    index = positions[..., None].expand(-1, -1, -1, 64)
    assert torch.equal(got_k, keys.gather(2, index)) and torch.equal(got_v, values.gather(2, index))
    assert torch.equal(layout.whole(cache, table, keys.shape[2]), keys)
    by_element = dataclasses.replace(layout, key_form=None, value_form=None)  # the fallback path
    assert all(torch.equal(a, b) for a, b in zip(by_element.gather(cache, table, positions), (got_k, got_v)))


def test_a_layout_the_probe_cannot_read_is_refused(monkeypatch):
    """A writer that does not place every element once (here: one that scales) is refused with
    the setting to change."""
    from specontext_vllm import layout as module

    real = ops.cpu_attn_reshape_and_cache

    def scaling(key, value, key_cache, value_cache, slots, isa, *rest):
        real(key * 3, value, key_cache, value_cache, slots, isa, *rest)

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", scaling)
    module._probe.cache_clear()
    try:
        with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
            probe_layout("vec", torch.float32, 32, 64)
    finally:
        module._probe.cache_clear()


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("group", [2, 3, 5])
def test_key_logits_over_packed_blocks_equal_float64(isa, dtype, use_kernel, group, monkeypatch):
    """The selection's logits read straight from the packed blocks (the C++ kernel where it
    reads the form, else torch over block copies) equal float64 products of the stored keys:
    within 1e-4 of the logits' scale (float32 accumulation; the torch path rounds the query
    to the cache's dtype: 2e-2 for bfloat16)."""
    from specontext_vllm import kernels

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    cache, table, keys, _ = _written(isa, dtype, 32, 0)
    layout = probe_layout(isa, dtype, 32, 64)
    if use_kernel:
        assert kernels.available() and (layout.key_form, dtype) in kernels.FORM_CODES
    else:
        monkeypatch.setattr(kernels, "FORM_CODES", {})
    blocks = keys.shape[2] // 32  # whole blocks only
    query = torch.randn(1, 3 * group, 64, generator=torch.Generator().manual_seed(3))  # 3 KV heads
    got = layout.key_logits(cache, table, blocks, query, 0.125)
    want = torch.einsum("kgd,knd->kgn", query.double().view(3, group, 64) * 0.125,
                        keys[0, :, :blocks * 32].double())
    tol = 2e-2 if (dtype == torch.bfloat16 and not use_kernel) else 1e-4
    assert got.shape == (1, 3, group, blocks * 32)
    assert float((got[0].double() - want).abs().max()) <= tol * float(want.abs().max())


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("group", [1, 3, 5])
def test_lagged_scores_in_one_call_equal_the_layers_softmaxes_summed(isa, dtype, group):
    """The selection's scores of several layers in one kernel call (each layer's logits kept in
    the thread's buffer) equal the per-layer path, ``group_max_probs`` of the torch logits
    summed, in float64: within 1e-5 of the scores' scale (the kernel's exponential: relative
    error under 3e-7); 0 at and past each row's ``past`` positions, rows with nothing past
    (past 0) all zero."""
    from specontext_compile.runtime.sparse_attention import group_max_probs

    from specontext_vllm import kernels

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    layout = probe_layout(isa, dtype, 32, 64)
    if (layout.key_form, dtype) not in kernels.FORM_CODES:
        pytest.skip(f"the kernel does not read {layout.key_form} keys")
    assert kernels.available()
    layers = [_written(isa, dtype, 32, seed) for seed in range(3)]  # same table (seeded), other keys
    caches, table = [c for c, *_ in layers], layers[0][1]
    blocks = layers[0][2].shape[2] // 32 + 1
    rows = 5
    table = table[:, :blocks].expand(rows, -1).contiguous()
    past = torch.tensor([0, 1, 33, 150, 97])
    gen = torch.Generator().manual_seed(7)
    queries = [torch.randn(rows, 3 * group, 64, generator=gen) * 3 for _ in layers]
    got = layout.lagged_scores(caches, table, blocks, queries, 0.125, past)
    positions = torch.arange(blocks * 32)
    allowed = positions < past.view(rows, 1, 1)
    want = sum(group_max_probs(layout.key_logits(c, table, blocks, q, 0.125).double(), allowed)
               for c, q in zip(caches, queries))
    assert got.shape == (rows, 3, blocks * 32) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * len(layers)
    assert bool((got[~allowed.expand(-1, 3, -1)] == 0).all()) and bool((got[0] == 0).all())
    mass = got[1:].sum(-1)  # per layer, the group maximum of distributions: between 1 and group
    assert bool((mass >= len(layers) - 1e-4).all()) and bool((mass <= len(layers) * group + 1e-4).all())
    assert torch.allclose(got[1], torch.nn.functional.one_hot(torch.tensor(0), blocks * 32).float() * len(layers))


def test_lagged_scores_refuse_what_they_cannot_read():
    """Caches of two dtypes, or a past beyond the blocks read, are refused before any read."""
    from specontext_vllm import kernels

    cache, table, keys, _ = _written("vec", torch.float32, 32, 0)
    blocks = keys.shape[2] // 32
    q = torch.zeros(2, 1, 3, 1, 64)
    with pytest.raises(ValueError, match="paged_lagged_scores"):
        kernels.paged_lagged_scores([cache, cache.bfloat16()], table, blocks, q, torch.tensor([5]), "transposed")
    with pytest.raises(ValueError, match="paged_lagged_scores"):
        kernels.paged_lagged_scores([cache, cache], table, blocks, q, torch.tensor([blocks * 32 + 1]), "transposed")
