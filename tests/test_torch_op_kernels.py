"""Our CPU kernels registered as the C++ kernels of their torch operators (``runtime/csrc/torch_op.h``).

Where this torch ships its stable C ABI (:func:`cpu_kernels.torch_op_flags`), the libraries of
the dense, refine and bfloat16 one-row linear kernels register the CPU kernels of
``specontext::cpu_decode_attention``, ``specontext::cpu_refine_attention`` and
``specontext::cpu_gemv_bf16``: a call of the operator (what the compiled step makes)
reaches C++ without a Python kernel. Checked: the C++ kernel serves the call (its own counter
moves, the Python kernel's does not), its output is bit for bit the Python kernel's (the same
arithmetic through ctypes) on float32, bfloat16 and float16 stores, masks, per-row lengths, the page
rescue and gathered rows, and it refuses inputs that would make it read out of bounds with a
RuntimeError naming the argument.
"""

from __future__ import annotations

import pytest
import torch
from specontext_compile.runtime import cpu_gemv, cpu_kernels, cpu_refine
from torch._dynamo.utils import counters

pytestmark = pytest.mark.skipif(cpu_kernels.torch_op_flags() is None or not cpu_kernels.available()
                                or not cpu_refine.available(),
                                reason="this torch has no stable C ABI headers, or no compiler builds the kernels")


def _op_calls(name: str) -> int:
    cpu_kernels.available(), cpu_refine.available(), cpu_gemv.available()  # the libraries loaded (kernels registered)
    assert name in cpu_kernels._OP_CALLS, f"the library of {name} was built without its operator kernel"
    return cpu_kernels._OP_CALLS[name]()


def _dense_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, kv, group, capacity, dim = 2, 3, 3, 300, 64
    query = torch.randn(b, kv * group, 1, dim, generator=gen) * dim ** -0.5
    keys = torch.randn(b, kv, capacity, dim, generator=gen).to(dtype)
    values = torch.randn(b, kv, capacity, dim, generator=gen).to(dtype)
    length = torch.tensor([capacity, 170])
    visible = torch.rand(b, capacity, generator=gen) > 0.2
    return query, keys, values, length, visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_operator_runs_the_cpp_kernel_bit_for_bit(dtype):
    query, keys, values, length, visible = _dense_inputs(dtype)
    python_before = counters["specontext"]["cpu_kernel_attention_calls"]
    want = cpu_kernels.cpu_decode_attention(query, keys, values, length, visible)  # the Python kernel
    assert counters["specontext"]["cpu_kernel_attention_calls"] == python_before + 1
    before = _op_calls("cpu_kernel_attention_calls")
    got = torch.ops.specontext.cpu_decode_attention(query, keys, values, length, visible)
    assert _op_calls("cpu_kernel_attention_calls") == before + 1  # C++ served it
    assert counters["specontext"]["cpu_kernel_attention_calls"] == python_before + 1  # not the Python kernel
    assert torch.equal(got, want)


def _refine_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, kv, group, capacity, dim, page_tokens = 1, 3, 3, 256, 64, 16
    query = torch.randn(b, kv * group, 1, dim, generator=gen) * dim ** -0.5
    keys = torch.randn(b, kv, capacity, dim, generator=gen).to(dtype)
    values = torch.randn(b, kv, capacity, dim, generator=gen).to(dtype)
    candidates = torch.stack([torch.randperm(capacity, generator=gen)[:40].sort().values for _ in range(kv)])[None]
    pages = capacity // page_tokens
    page_min = keys.view(b, kv, pages, page_tokens, dim).amin(3).contiguous()
    page_max = keys.view(b, kv, pages, page_tokens, dim).amax(3).contiguous()
    return query, keys, values, candidates, torch.tensor(capacity - 5), page_min, page_max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rescue", [0, 4])
def test_refine_operator_runs_the_cpp_kernel_bit_for_bit(dtype, rescue):
    query, keys, values, candidates, length, page_min, page_max = _refine_inputs(dtype)
    bounds = (page_min, page_max) if rescue else (None, None)
    args = (query, keys, values, candidates, length, None, *bounds, None, None, None, 24, 2, 8, rescue, 16)
    want = cpu_refine.cpu_refine_attention(*args)
    before = _op_calls("cpu_kernel_refine_calls")
    got = torch.ops.specontext.cpu_refine_attention(*args)
    assert _op_calls("cpu_kernel_refine_calls") == before + 1
    assert torch.equal(got, want)


def test_refine_operator_over_gathered_rows_is_the_python_kernel():
    """An offloaded layer's call: the rescued candidates' rows gathered elsewhere."""
    query, keys, values, candidates, length, page_min, page_max = _refine_inputs(torch.float32, seed=1)
    union = cpu_refine.cpu_rescue_candidates(query, keys, candidates, length, None, page_min, page_max, None, 4, 16)
    rows = union.clamp(min=0)[..., None].expand(-1, -1, -1, keys.shape[-1])
    gathered = (keys.gather(2, rows).contiguous(), values.gather(2, rows).contiguous())
    args = (query, keys, values, union, length, None, None, None, None, *gathered, 24, 2, 8, 0, 16)
    assert torch.equal(torch.ops.specontext.cpu_refine_attention(*args), cpu_refine.cpu_refine_attention(*args))


def test_operators_refuse_what_would_read_out_of_bounds():
    query, keys, values, length, visible = _dense_inputs(torch.float32)
    dense = torch.ops.specontext.cpu_decode_attention
    for args, word in (((query.double(), keys, values, length, None), "query"),
                       ((query, keys, values[:, :2], length, None), "value_cache"),
                       ((query, keys, values.bfloat16(), length, None), "one dtype"),
                       ((query, keys, values, length.int(), None), "length"),
                       ((query, keys, values, length, visible[:, :7]), "visible")):
        with pytest.raises(RuntimeError, match=word):
            dense(*args)
    with pytest.raises(RuntimeError, match=r"one query row.*got query \[2, 9, 2, 64\], key_cache \[2, 3, 300, 64\]"):
        dense(torch.cat([query, query], 2), keys, values, length, None)  # the message names what was given
    query, keys, values, candidates, length, page_min, page_max = _refine_inputs(torch.float32)
    refine = torch.ops.specontext.cpu_refine_attention
    base = (query, keys, values, candidates, length, None, page_min, page_max, None, None, None, 24, 2, 8)
    for args, word in ((base[:3] + (candidates.int(),) + base[4:] + (4, 16), "candidates"),
                       (base[:7] + (page_max[:, :2],) + base[8:] + (4, 16), "page_max"),
                       (base[:11] + (0, 2, 8, 4, 16), "budget"),
                       (base[:6] + (None, None) + base[8:] + (4, 16), "page rescue needs"),
                       (base[:9] + (keys, values) + base[11:] + (4, 16), "gathered")):
        with pytest.raises(RuntimeError, match=word):
            refine(*args)


def test_gemv_operator_runs_the_cpp_kernel_bit_for_bit():
    """``specontext::cpu_gemv_bf16`` through its C++ kernel (no Python per call): its counter
    moves, the Python kernel's does not, the outputs are the Python kernel's bit for bit (the
    same C function), and it refuses a bad weight with a RuntimeError naming it."""
    if not cpu_gemv.available():
        pytest.skip("the bfloat16 linear kernel does not build here")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, generator=gen).bfloat16()
    weights = [torch.randn(n, 96, generator=gen).bfloat16() for n in (40, 7, 1)]
    want = cpu_gemv.cpu_gemv_bf16(x, weights)  # the Python kernel
    python_before = counters["specontext"]["cpu_kernel_gemv_calls"]
    before = _op_calls("cpu_kernel_gemv_calls")
    got = torch.ops.specontext.cpu_gemv_bf16(x, weights)
    assert _op_calls("cpu_kernel_gemv_calls") == before + 1  # C++ served it
    assert counters["specontext"]["cpu_kernel_gemv_calls"] == python_before  # not the Python kernel
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for bad, word in (([weights[0].t()], "contiguous bfloat16 CPU weights"), ([weights[0].float()], "weight"),
                      ([], "1 to 16 weights")):
        with pytest.raises(RuntimeError, match=word):
            torch.ops.specontext.cpu_gemv_bf16(x, bad)
