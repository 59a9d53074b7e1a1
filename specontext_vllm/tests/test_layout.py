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
