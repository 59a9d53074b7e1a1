"""The bfloat16 one-row linear kernel (``runtime/cpu_gemv.py``, ``csrc/gemv_bf16.cpp``, issue 51):
its products against float64, its refusals, where ``passes/gemv.py`` sends a linear to it and
where not, and a compiled bfloat16 step that runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from specontext_compile.passes.gemv import one_row_linear, rewrite_one_row_linears
from specontext_compile.runtime import cpu_gemv, cpu_kernels, torch_private
from test_backend_e2e import decode_logits

import specontext_compile as sc


def _gemv_calls() -> int:
    """Calls of the kernel, through its C++ operator kernel or its Python one."""
    return cpu_kernels.kernel_calls()["cpu_kernel_gemv_calls"]

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(), reason="no C++ compiler builds the kernel here")
needs_native = pytest.mark.skipif(not cpu_gemv.native(), reason="this CPU has no AVX512_BF16: the pass keeps inductor's")


@pytest.fixture
def gate_open(monkeypatch):
    """The kernel's mechanics on any AVX512_BF16 CPU: the machine gate (``faster_here``, AMX
    as the proxy for where it was measured faster) opened, whatever CPU runs the test."""
    monkeypatch.setattr(cpu_gemv, "faster_here", lambda: True)


def _bound(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What rounding may cost per output: the sum rounded once to bfloat16 (a relative 2^-9 of
    the sum, at most 2^-9 of the sum of the products' magnitudes), float32 accumulation (far
    below), twice over for margin."""
    return (weight.double().abs() @ x.double().abs()) * 2.0**-8 + 1e-37


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.integers(1, 300), st.integers(0, 2**16), st.sampled_from([1.0, 1e-3, 300.0]))
def test_products_equal_float64_within_one_bfloat16_rounding(out_features, in_features, seed, scale):
    """Every row count (four-row blocks and the rest) and input width (32-wide steps and a
    masked tail) against the float64 product of the same bfloat16 values."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * scale).bfloat16()
    x = torch.randn(in_features, generator=gen).bfloat16()
    got, = cpu_gemv.cpu_gemv_bf16(x, [weight])
    assert got.dtype == torch.bfloat16 and got.shape == (out_features,)
    want = weight.double() @ x.double()
    assert ((got.double() - want).abs() <= _bound(weight, x)).all()


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(1, 130), st.integers(0, 2**16))
def test_several_weights_of_one_row_in_one_call(outs, in_features, seed):
    """One call over several weights (a layer's query, key and value projections): each output
    as its own product, the four-row blocks of every weight shared out between the threads."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o, in_features, generator=gen).bfloat16() for o in outs]
    x = torch.randn(in_features, generator=gen).bfloat16()
    for weight, got in zip(weights, cpu_gemv.cpu_gemv_bf16(x, weights), strict=True):
        assert ((got.double() - weight.double() @ x.double()).abs() <= _bound(weight, x)).all()


@needs_kernel
def test_bad_inputs_are_named_before_any_read():
    w, x = torch.randn(4, 8).bfloat16(), torch.randn(8).bfloat16()
    with pytest.raises(ValueError, match="bfloat16 CPU input"):
        cpu_gemv.cpu_gemv_bf16(x.float(), [w])
    with pytest.raises(ValueError, match="contiguous: False"):
        cpu_gemv.cpu_gemv_bf16(torch.randn(4).bfloat16(), [w.t()])
    with pytest.raises(ValueError, match="weight torch.bfloat16 \\(4, 8\\)"):
        cpu_gemv.cpu_gemv_bf16(torch.randn(7).bfloat16(), [w])
    with pytest.raises(ValueError, match="in_features >= 1"):
        cpu_gemv.cpu_gemv_bf16(torch.randn(0).bfloat16(), [torch.randn(4, 0).bfloat16()])
    with pytest.raises(ValueError, match="1 to 16 weights"):
        cpu_gemv.cpu_gemv_bf16(x, [])


def _linear_graph(x: torch.Tensor, w: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(lambda x, w: F.linear(x, w))
    x_node, w_node = list(gm.graph.nodes)[:2]
    x_node.meta["example_value"], w_node.meta["example_value"] = x, w
    return gm


def _target(x: torch.Tensor, w: torch.Tensor):
    gm = _linear_graph(x, w)
    assert rewrite_one_row_linears(gm.graph) == 1
    return next(n.target for n in gm.graph.nodes if n.op == "call_function")


@needs_native
@pytest.mark.usefixtures("gate_open")
def test_the_pass_sends_bfloat16_rows_to_the_kernel_and_nothing_else():
    """A one-row bfloat16 linear goes to the kernel; float32, a transposed weight, and a weight
    that carries a gradient (the op has no backward) keep inductor's reduction."""
    x, w = torch.randn(1, 1, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    assert _target(x, w) is cpu_gemv.one_row_linear
    assert _target(x.float(), w.float()) is one_row_linear
    assert _target(x, torch.randn(64, 32).bfloat16().t()) is one_row_linear
    with torch.enable_grad():
        assert _target(x, torch.nn.Parameter(w)) is one_row_linear
    with torch.no_grad():
        assert _target(x, torch.nn.Parameter(w)) is cpu_gemv.one_row_linear


@needs_native
def test_a_cpu_where_the_kernel_measured_slower_keeps_inductors_reduction(monkeypatch):
    """The machine gate closed (a CPU without AMX, where the kernel made the step slower): the
    pass keeps inductor's reduction for the same bfloat16 row it otherwise sends to the
    kernel; the gate follows the AMX probe."""
    x, w = torch.randn(1, 1, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    monkeypatch.setattr(cpu_gemv, "faster_here", lambda: False)
    assert _target(x, w) is one_row_linear
    monkeypatch.setattr(cpu_gemv, "faster_here", lambda: True)
    assert _target(x, w) is cpu_gemv.one_row_linear
    monkeypatch.undo()
    assert cpu_gemv.faster_here() == torch_private.cpu_has_amx()


@needs_native
@pytest.mark.usefixtures("gate_open")
def test_the_rewritten_graph_computes_the_linear():
    x, w = torch.randn(1, 1, 96).bfloat16(), torch.randn(40, 96).bfloat16()
    gm = _linear_graph(x, w)
    rewrite_one_row_linears(gm.graph)
    gm.recompile()
    before = _gemv_calls()
    got = gm(x, w)
    assert _gemv_calls() == before + 1
    assert got.shape == (1, 1, 40)
    assert ((got.double() - F.linear(x.double(), w.double())).abs() <= _bound(w, x[0, 0])).all()


@needs_native
@pytest.mark.usefixtures("gate_open")
def test_a_compiled_bfloat16_step_runs_the_kernel_with_inductors_logits():
    """The default options' bfloat16 step on CPU: every one-row linear of each decode step runs
    the kernel, in 4 calls per layer (query, key and value in one; output; gate and up in one;
    down) and one for the LM head, and the logits equal those of the same step with inductor's
    reduction (``applies`` patched False) within bfloat16 rounding of the sums."""
    model = tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))

    def run():
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="specontext", options={"budget": 8})
        return decode_logits(model, compiled, ids, 3, sc.SpeContextCache(model.config, max_cache_len=40))

    before = _gemv_calls()
    got = run()
    assert _gemv_calls() - before == 3 * (4 * model.config.num_hidden_layers + 1)
    with pytest.MonkeyPatch.context() as patch, torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        patch.setattr(cpu_gemv, "applies", lambda *a, **k: False)
        want = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)


@needs_native
@pytest.mark.usefixtures("gate_open")
def test_the_linears_of_one_row_share_one_call_and_a_biased_one_keeps_its_own():
    """Three bias-free linears of one input row (query, key, value) become one call of the
    kernel; a fourth with a bias stays a call of its own; the graph computes the four linears."""
    def f(x, wq, wk, wv, wo, bo):
        return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv), F.linear(x, wo, bo)

    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(1, 1, 64).bfloat16()
    args = (x, *(torch.randn(o, 64).bfloat16() for o in (32, 8, 8, 16)), torch.randn(16).bfloat16())
    for node, value in zip(list(gm.graph.nodes)[:6], args):
        node.meta["example_value"] = value
    assert rewrite_one_row_linears(gm.graph) == 4
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(cpu_gemv.one_row_linears) == 1 and targets.count(cpu_gemv.one_row_linear) == 1
    gm.recompile()
    before = _gemv_calls()
    got = gm(*args)
    assert _gemv_calls() == before + 2
    for out, weight, bias in zip(got, args[1:5], (None, None, None, args[5])):
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        assert ((out.double() - want).abs() <= _bound(weight, x[0, 0]) + 2.0**-7 * want.abs()).all()
