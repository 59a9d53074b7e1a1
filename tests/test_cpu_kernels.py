"""Our CPU decode attention kernel (runtime/cpu_kernels.py, csrc/decode_attention.cpp): values
against float64 attention, which sites it serves, and the compiled dense step that calls it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.runtime import aten_step, cpu_kernels, routes
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from test_backend_e2e import decode_logits
from torch.fx.experimental.proxy_tensor import make_fx

import specontext_compile as sc

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler to build the CPU kernel")


def _reference(query, keys, values, length, visible, scale):
    """float64 attention of one row per head over slots < length (and visible)."""
    b, num_heads, _, d = query.shape
    num_kv, capacity = keys.shape[1], keys.shape[2]
    q = query.double().view(b, num_kv, num_heads // num_kv, d) * scale
    logits = q @ keys.double().transpose(-1, -2)  # [b, kv, g, capacity]
    allowed = (torch.arange(capacity) < length.reshape(-1, 1, 1, 1))
    if visible is not None:
        allowed = allowed & visible.reshape(-1, 1, 1, capacity)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return (probs @ values.double()).view(b, num_heads, 1, d)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), num_kv=st.integers(1, 4), groups=st.integers(1, 8),
       capacity=st.one_of(st.integers(1, 70), st.sampled_from([255, 256, 257, 1000])),
       d=st.sampled_from([8, 16, 64, 72, 128]), per_row=st.booleans(), hide=st.floats(0.0, 1.0),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_kernel_equals_float64_attention(seed, b, num_kv, groups, capacity, d, per_row, hide, dtype, data):
    """Any group size, head_dim, store size, per-row lengths (0: the row sees nothing and gets
    zeros), hidden slots, float32, bfloat16 or float16 stores: within 2e-5 of float64 over the
    stores' own values (float32 accumulation over <= 1000 slots; a 16-bit element widens exactly)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, num_kv * groups, 1, d, generator=gen)
    keys, values = (torch.randn(b, num_kv, capacity, d, generator=gen).to(dtype) for _ in range(2))
    if per_row:
        length = torch.tensor(data.draw(st.lists(st.integers(0, capacity), min_size=b, max_size=b)))
    else:
        length = torch.tensor(data.draw(st.integers(0, capacity)))
    visible = (torch.rand(b, capacity, generator=gen) >= hide) if hide > 0.5 else None
    got = cpu_kernels.cpu_decode_attention(query * 0.3, keys, values, length, visible)
    torch.testing.assert_close(got.double(), _reference(query, keys, values, length, visible, 0.3),
                               atol=2e-5, rtol=2e-5)


def test_kernel_rejects_what_it_does_not_take():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="one query row"):
        cpu_kernels.cpu_decode_attention(q, k, k, torch.tensor(5), None)
    assert not cpu_kernels.applies(q, k, k, None)  # two query rows
    q1 = q[:, :, :1]
    assert cpu_kernels.applies(q1, k, k, None)
    assert cpu_kernels.applies(q1.bfloat16(), k.bfloat16(), k.bfloat16(), None)
    assert cpu_kernels.applies(q1.half(), k.half(), k.half(), None)
    assert not cpu_kernels.applies(q1.half(), k.bfloat16(), k.bfloat16(), None)  # query and stores differ
    assert not cpu_kernels.applies(q1, k.bfloat16(), k.bfloat16(), None)  # the query in another dtype
    assert not cpu_kernels.applies(q1, k, k, torch.zeros(1, 1, 1, 10))  # additive mask: may carry a bias
    assert not cpu_kernels.applies(q1, k, k, torch.ones(1, 4, 1, 10, dtype=torch.bool))  # a mask per head
    assert cpu_kernels.applies(q1, k, k, torch.ones(1, 1, 1, 10, dtype=torch.bool))


def test_bad_inputs_are_clear_errors_not_reads_out_of_bounds():
    """Inputs that do not agree (batch, head_dim, value shape, dtype, mask width, KV heads) are
    ValueErrors naming the argument before the kernel reads memory (found by a review: a store
    with a smaller batch than the query read past its end)."""
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 40, 16)
    n = torch.tensor(30)
    bad = [
        ((torch.randn(256, 1, 1, 16), torch.randn(1, 1, 70, 16), torch.randn(1, 1, 70, 16), n, None), "batch"),
        ((q, k[..., :8], k, n, None), "value_cache"),
        ((q, k, k[:, :, :10], n, None), "value_cache"),
        ((q.double(), k, k, n, None), "float32"),
        ((q.bfloat16(), k.bfloat16(), k.bfloat16(), n, None), "float32"),  # the query: scaled in float32
        ((q, k.double(), k.double(), n, None), "float16"),
        ((q, k, k.bfloat16(), n, None), "one dtype"),
        ((q, k, k, n.int(), None), "int64"),
        ((q, k, k, n, torch.rand(1, 80) > 0.5), "visible"),
        ((q, k, k, n, torch.ones(2, 39, dtype=torch.bool)), "visible"),
        ((q, k, k, n, torch.ones(2, 40)), "visible"),
        ((torch.randn(1, 2, 1, 8), torch.randn(1, 0, 10, 8), torch.randn(1, 0, 10, 8), n, None), "KV heads"),
    ]
    for args, word in bad:
        with pytest.raises(ValueError, match=word):
            cpu_kernels.cpu_decode_attention(*args)
    # a length or mask on another device (CUDA) is refused before its pointer is read (a meta
    # tensor stands in for it: called through the op, meta dispatches to the fake kernel)
    for args in ((q, k, k, n.to("meta"), None), (q, k, k, n, torch.ones(2, 40, dtype=torch.bool, device="meta"))):
        with pytest.raises(ValueError, match="CPU tensor"):
            cpu_kernels.check_inputs(*args)
    empty = k[:, :, :0]  # a store of no slots: zeros, with or without a mask
    for visible in (None, torch.ones(2, 0, dtype=torch.bool)):
        assert cpu_kernels.cpu_decode_attention(q, empty, empty, torch.tensor(0), visible).abs().sum() == 0


def test_a_hidden_slots_garbage_never_reaches_the_output():
    """A hidden slot's value is never read: NaN there leaves the output finite and equal to
    float64's over the visible slots."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 1, 16, generator=gen), *(torch.randn(2, 2, 40, 16, generator=gen) for _ in range(2))
    visible = torch.ones(2, 40, dtype=torch.bool)
    visible[:, 5] = False
    v[0, 0, 5, 2] = float("nan")
    k[1, 1, 5, 0] = float("inf")
    n = torch.tensor(33)
    got = cpu_kernels.cpu_decode_attention(q, k, v, n, visible)
    v_ref = v.clone()
    v_ref[:, :, 5] = 0.0
    k_ref = k.clone()
    k_ref[:, :, 5] = 0.0
    torch.testing.assert_close(got.double(), _reference(q, k_ref, v_ref, n, visible, 1.0), atol=2e-5, rtol=2e-5)


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv("SPECONTEXT_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(cpu_kernels.KernelBuildError, match="install g\\+\\+"):
        cpu_kernels._library.__wrapped__()


def _traced_dense(query, keys, values, length, attn_mask):
    """The dense body traced as inductor gets it: the variant as the lowering leaves it, the
    kernel as the pass decides it for these values (``routes.cpu_kernel`` on the dense route)."""
    variant = AttentionVariant(0.25, fused_products=True)  # as the lowering leaves it for inductor
    spec = StepSpec(8, 8, dense_shortcut=True, compiled=True)
    kernel = routes.cpu_kernel(query, (keys, values), attn_mask, spec, variant, dense=True, slots=None)
    return make_fx(lambda q, k, v, n, m: aten_step._dense_store_attention(q, k, v, n, m, variant, kernel=kernel))(
        query, keys, values, length, attn_mask)


def _calls_kernel(gm) -> bool:
    return any(n.target is torch.ops.specontext.cpu_decode_attention.default for n in gm.graph.nodes)


def test_the_traced_dense_decode_body_calls_the_kernel_only_where_it_applies(monkeypatch):
    """A float32, bfloat16 or float16 decode row with a boolean (or no) mask: the kernel, equal
    to float64; two rows, an additive mask, or the library unavailable: inductor's body, no
    kernel call."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 1, 16, generator=gen), *(torch.randn(1, 2, 300, 16, generator=gen) for _ in range(2))
    n = torch.tensor(290)
    mask = torch.arange(300).view(1, 1, 1, 300) >= 7  # left padding: 7 hidden slots
    gm = _traced_dense(q, k, v, n, mask)
    assert _calls_kernel(gm)
    torch.testing.assert_close(gm(q, k, v, n, mask).double(), _reference(q, k, v, n, mask[0, 0], 0.25),
                               atol=2e-5, rtol=2e-5)
    assert not _calls_kernel(_traced_dense(torch.randn(1, 6, 2, 16), k, v, n, None))
    for dtype, tol in ((torch.bfloat16, (4e-3, 8e-3)), (torch.float16, (5e-4, 1e-3))):  # (atol, rtol)
        q16, k16, v16 = (t.to(dtype) for t in (q, k, v))
        gm = _traced_dense(q16, k16, v16, n, None)
        assert _calls_kernel(gm)
        out = gm(q16, k16, v16, n, None)
        assert out.dtype == dtype  # float32 inside, rounded once to the query's dtype
        torch.testing.assert_close(out.double(), _reference(q16, k16, v16, n, None, 0.25), atol=tol[0], rtol=tol[1])
    assert not _calls_kernel(_traced_dense(q, k, v, n, torch.zeros(1, 1, 1, 300)))
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert not _calls_kernel(_traced_dense(q, k, v, n, mask))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_the_compiled_dense_step_runs_the_kernel_with_eager_logits(dtype):
    """A budget above the store (every site dense over it), compiled by inductor on CPU: each
    decode step's sites run our kernel (its counter), and the logits equal Hugging Face eager's;
    a float16 model too (slow tier; eager SDPA rounds its float16 products: that tolerance)."""
    model = tiny_llama().to(dtype)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    eager = decode_logits(model, model.forward, ids, 4, sc.SpeContextCache(model.config, max_cache_len=64))
    before = cpu_kernels.kernel_calls()["cpu_kernel_attention_calls"]  # Python and C++ operator kernels
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 4096})
    got = decode_logits(model, compiled, ids, 4, sc.SpeContextCache(model.config, max_cache_len=64))
    assert cpu_kernels.kernel_calls()["cpu_kernel_attention_calls"] - before == 4 * model.config.num_hidden_layers
    for a, b in zip(got, eager):
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("target", [("-march=haswell",), ("-march=x86-64", "-mno-f16c")], ids=["avx2", "x86-64"])
def test_every_kernel_source_compiles_for_cpus_without_avx512(target):
    """Our kernels build with ``-march=native``: on a CPU without AVX-512 (AVX2 only, or not even
    F16C) the portable loops and the software float16 conversion must compile (a review found the
    refine and selection kernels did not: a helper declared only under ``__AVX512F__``). Syntax and
    templates only (``-fsyntax-only``), for every source the package builds."""
    import shutil
    import subprocess

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    csrc = Path(cpu_kernels.__file__).with_name("csrc")
    for source in sorted(csrc.glob("*.cpp")):
        done = subprocess.run([compiler, "-fsyntax-only", "-std=c++17", "-fopenmp", *target, str(source)],
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{source.name}: {done.stderr[-2000:]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_that_hides_only_unwritten_slots_is_dropped(dtype):
    """Hugging Face's decode mask (every written slot visible): the kernel runs its mask-free
    path (csrc/cpu_common.h, needed_mask; counted) with the output of a call without a mask,
    bit for bit; a mask that hides one written slot is kept (not counted) and matches float64."""
    gen = torch.Generator().manual_seed(5)
    b, kv, group, capacity, dim = 2, 3, 3, 1000, 64
    query = torch.randn(b, kv * group, 1, dim, generator=gen)
    keys, values = (torch.randn(b, kv, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    length = torch.tensor([900, 333])
    written = torch.arange(capacity) < length.view(b, 1)
    lib = cpu_kernels._library()
    before = cpu_kernels.masks_dropped(lib, "decode_attention")
    plain = cpu_kernels.cpu_decode_attention(query * 0.3, keys, values, length, None)
    assert torch.equal(cpu_kernels.cpu_decode_attention(query * 0.3, keys, values, length, written), plain)
    assert cpu_kernels.masks_dropped(lib, "decode_attention") == before + 1
    hidden = written.clone()
    hidden[0, 17] = False
    got = cpu_kernels.cpu_decode_attention(query * 0.3, keys, values, length, hidden)
    assert cpu_kernels.masks_dropped(lib, "decode_attention") == before + 1
    torch.testing.assert_close(got.double(), _reference(query, keys, values, length, hidden, 0.3), atol=2e-5, rtol=2e-5)
