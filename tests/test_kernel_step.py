"""The generated Triton kernel inside the compiled step (runtime/kernel_step.py, issue 27 item 6).

On CPU: the op's body (the kernels launched through ``wrap_triton``) runs under the Triton
interpreter and is checked against float64 attention; the op's CPU body is the kernel in the
interpreter, or the torch reference without it; a bool mask folded into the selection gives
the masked attention; the route decision (``runtime/routes.py``, the pass's, once per site)
sends exactly the sites the kernel can serve to it (decided from fake CUDA tensors, so the
decision is tested here; tests/test_cuda.py runs it on a device) and the lowering follows the
route it is given, never deciding again.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specontext_compile.passes.lower import lower_to_aten
from specontext_compile.runtime import aten_step, kernel_step, routes
from specontext_compile.runtime.sparse_attention import sparse_attention_reference
from specontext_compile.runtime.spec import AttentionVariant, StepSpec
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _case(batch, heads, kv_heads, capacity, budget, length, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, 1, 64, generator=gen).to(dtype)
    key = torch.randn(batch, kv_heads, capacity, 64, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, capacity, 64, generator=gen).to(dtype)
    # distinct written positions per row, some slots padding (-1)
    order = torch.rand(batch, kv_heads, length, generator=gen).argsort(-1)[..., :budget]
    pad = torch.rand(batch, kv_heads, order.shape[-1], generator=gen) < 0.2
    indices = torch.where(pad, -1, order)
    return query, key, value, indices, torch.tensor(length)


def _float64(query, key, value, indices, length, mask=None, soft_cap=None, window=0):
    return sparse_attention_reference(query.double(), key.double(), value.double(), indices, length, mask,
                                      AttentionVariant(64 ** -0.5, soft_cap, window))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), groups=st.sampled_from([1, 3]), kv_heads=st.integers(1, 2),
       budget=st.integers(1, 40), seed=st.integers(0, 100), soft_cap=st.sampled_from([None, 0.5]),
       window=st.sampled_from([0, 12]))
def test_the_ops_cuda_body_launched_through_wrap_triton_equals_float64_attention(batch, groups, kv_heads,
                                                                                   budget, seed, soft_cap, window):
    """The body the op runs on CUDA (the generated split and merge kernels, each launched
    through ``wrap_triton``), here under the interpreter: within 1e-5 of float64, for every
    variant the lowering sends it (plain, a soft cap, a sliding window, both)."""
    query, key, value, indices, length = _case(batch, groups * kv_heads, kv_heads, 64, budget, 50, seed=seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fixture sets the interpreter on CPU
    out = kernel_step.launch_generated(*(t.to(device) for t in (query, key, value, indices, length)),
                                       64 ** -0.5, soft_cap, window, False).cpu()
    torch.testing.assert_close(out.double(), _float64(query, key, value, indices, length, None, soft_cap, window),
                               atol=1e-5, rtol=1e-5)


def test_the_ops_cpu_body_is_the_kernel_in_the_interpreter_else_the_torch_reference(monkeypatch):
    """On CPU tensors the op runs the kernel in Triton's interpreter (``kernel="triton"`` on CPU:
    the one route to the kernel), within 1e-5 of float64; without the interpreter, the torch
    reference (its oracle) bit for bit."""
    query, key, value, indices, length = _case(2, 6, 2, 64, 24, 50)
    expected = sparse_attention_reference(query, key, value, indices, length, None, AttentionVariant(64 ** -0.5, 0.5, 12))
    launched = []
    real = kernel_step.sparse_attention_reference
    monkeypatch.setattr(kernel_step, "sparse_attention_reference", lambda *a: launched.append(1) or real(*a))
    out = kernel_step.generated_attention(query, key, value, indices, length, 64 ** -0.5, 0.5, 12, False)
    torch.testing.assert_close(out.double(), _float64(query, key, value, indices, length, None, 0.5, 12),
                               atol=1e-5, rtol=1e-5)
    assert not launched  # the interpreter ran the kernel
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch.equal(kernel_step.generated_attention(query, key, value, indices, length, 64 ** -0.5, 0.5, 12, False),
                       expected) and launched


def _latent_case(seed=0, heads=4, capacity=40, r=32, p=16, budget=12, length=30):
    """A multi-head latent attention site: absorbed query ``[1, heads, 1, r + p]``, latent and
    rotary key stores ``[1, 1, capacity, r|p]``, a selection with padding slots."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, 1, r + p, generator=gen)
    latent, rope = torch.randn(1, 1, capacity, r, generator=gen), torch.randn(1, 1, capacity, p, generator=gen)
    indices = torch.rand(1, 1, length, generator=gen).argsort(-1)[..., :budget]
    indices[..., 1] = -1
    return query, latent, rope, indices, torch.tensor(length)


def _latent_float64(query, latent, rope, indices, length, scale):
    """The MLA torch path (``mla.mla_sparse_attention``, which splits the absorbed query and
    reads the two stores itself) in float64: independent of the op's own argument order."""
    from specontext_compile.runtime.mla import mla_sparse_attention

    budget = indices.shape[-1]
    return mla_sparse_attention(query.double(), latent.double(), rope.double(), indices, length, None,
                                StepSpec(budget, budget), AttentionVariant(scale, nope_dim=1))


@pytest.mark.parametrize("interpreted", [True, False], ids=["interpreter", "reference"])
def test_the_one_op_serves_the_latent_layout(monkeypatch, interpreted):
    """Multi-head latent attention reaches the generated MLA kernel through the same op as the
    plain layout (``generated_attention(..., latent=True)``; issue 53: one route to the
    kernels): in the interpreter the MLA kernel runs (the torch reference is not called), without
    it the reference does; both within 1e-5 of float64 attention over the concatenated keys
    with the latent rows as values."""
    query, latent, rope, indices, length = _latent_case()
    called = []
    real = kernel_step.sparse_attention_reference
    monkeypatch.setattr(kernel_step, "sparse_attention_reference", lambda *a: called.append(1) or real(*a))
    if not interpreted:
        monkeypatch.delenv("TRITON_INTERPRET")
    out = kernel_step.generated_attention(query, latent, rope, indices, length, 0.2, None, 0, True)
    assert out.shape == (1, 4, 1, 32) and bool(called) is not interpreted
    torch.testing.assert_close(out.double(), _latent_float64(query, latent, rope, indices, length, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_the_ops_cuda_body_launches_the_mla_kernel_through_wrap_triton():
    """The body the op runs on CUDA for a latent site (the MLA split and the merge kernel, each
    through ``wrap_triton``), here under the interpreter: within 1e-5 of float64."""
    query, latent, rope, indices, length = _latent_case(seed=4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = kernel_step.launch_generated(*(t.to(device) for t in (query, latent, rope, indices, length)), 0.2, None,
                                       0, True).cpu()
    torch.testing.assert_close(out.double(), _latent_float64(query, latent, rope, indices, length, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_a_bool_mask_is_folded_into_the_selection_exactly():
    """A left-padded row's bool mask: the folded selection attends as the masked reference
    (hidden positions become -1 slots), checked against float64."""
    query, key, value, _, length = _case(2, 6, 2, 64, 64, 50)
    indices = torch.arange(50).expand(2, 2, 50).contiguous()  # every written position selected
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    mask[1, ..., :7] = False  # row 1: seven pad tokens
    spec, variant = StepSpec(50, 50, kernel="auto"), AttentionVariant(64 ** -0.5)
    out = kernel_step.kernel_attention(query, key, value, indices, length, mask, spec, variant)
    torch.testing.assert_close(out.double(), _float64(query, key, value, indices, length, mask), atol=1e-5, rtol=1e-5)
    unmasked = kernel_step.kernel_attention(query, key, value, indices, length, None, spec, variant)
    assert torch.equal(out[0], unmasked[0]) and not torch.allclose(out[1], unmasked[1])


def _fake(*shapes_dtypes, device="cuda"):
    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes_dtypes]


_SITE = [((1, 9, 1, 64), torch.bfloat16), ((1, 3, 256, 64), torch.bfloat16), ((1, 3, 256, 64), torch.bfloat16),
         ((1, 3, 32), torch.int64), ((), torch.int64)]


def _site_graph(values, mask=None, spec=None, variant=None, key="example_value"):
    """A graph holding one ``specontext::sparse_attention`` node over placeholders whose
    example values are ``values`` (+ ``mask``), kept under ``meta[key]`` (dynamo's graphs,
    which the backend lowers, use ``example_value``; AOT's use ``val``)."""
    graph = fx.Graph()
    names = ("query", "key_cache", "value_cache", "indices", "length")
    nodes = []
    for name, value in zip(names, values):
        node = graph.placeholder(name)
        node.meta[key] = value
        nodes.append(node)
    mask_node = None
    if mask is not None:
        mask_node = graph.placeholder("attn_mask")
        mask_node.meta[key] = mask
    spec = spec or StepSpec(32, 32, kernel="auto", route="kernel")
    variant = variant or AttentionVariant(0.125)
    out = graph.call_function(torch.ops.specontext.sparse_attention.default, (*nodes, mask_node, spec, variant))
    graph.output(out)
    return graph, out


@pytest.mark.parametrize("key", ["example_value", "val"])
def test_the_lowering_sends_a_plain_cuda_site_to_the_kernel(key):
    graph, node = _site_graph(_fake(*_SITE), key=key)
    result = lower_to_aten(graph, kernel_device=True)
    assert node.target is kernel_step.kernel_attention and result.kernel == 1 and not result.kernel_refused


def test_the_lowering_sends_an_mla_cuda_site_to_the_same_kernel_route():
    """A multi-head latent attention site routed to the kernel on CUDA graphs takes the plain
    layout's route (``kernel_attention``, inductor sees the MLA kernel through the
    ``triton_op``); off CUDA it stays the op (the interpreter), as a plain site does."""
    site = [((1, 8, 1, 48), torch.bfloat16), ((1, 1, 256, 32), torch.bfloat16), ((1, 1, 256, 16), torch.bfloat16),
            ((1, 1, 32), torch.int64), ((), torch.int64)]
    variant = AttentionVariant(0.125, nope_dim=16)
    graph, node = _site_graph(_fake(*site), variant=variant)
    result = lower_to_aten(graph, kernel_device=True)
    assert node.target is kernel_step.kernel_attention and result.kernel == 1
    graph, node = _site_graph(_fake(*site, device="cpu"), variant=variant)
    result = lower_to_aten(graph)
    assert node.target is torch.ops.specontext.sparse_attention.default and result.kernel == 0


def test_the_lowering_follows_the_route_and_never_decides():
    """Negative: a site routed to the gather path stays on the torch body even where the kernel
    could serve it (CUDA tensors, kernel_device); a kernel site of CPU tensors (Triton's
    interpreter) stays the op; a kernel site on CUDA lowered without the kernel (the backend's
    fallback) goes to the gather path, its spec's route with it."""
    graph, node = _site_graph(_fake(*_SITE), spec=StepSpec(32, 32, kernel="auto", route="gather"))
    result = lower_to_aten(graph, kernel_device=True)
    assert node.target is aten_step.sparse_attention and result.kernel == 0 and not result.kernel_refused
    graph, node = _site_graph(_fake(*_SITE, device="cpu"))
    result = lower_to_aten(graph)
    assert node.target is torch.ops.specontext.sparse_attention.default and result.kernel == 0
    assert "specontext::sparse_attention" in result.kept
    graph, node = _site_graph(_fake(*_SITE))
    result = lower_to_aten(graph, kernel_device=True, no_kernel=True)
    assert node.target is aten_step.sparse_attention and sum(result.kernel_refused.values()) == 1
    assert node.args[6].route == "gather"


def test_the_pass_decides_each_sites_route_from_dynamos_example_values(monkeypatch):
    """The real backend on a tiny Llama (CPU): the rewrite pass asks :func:`routes.decide` once
    per decode site, with dynamo's example values (CPU tensors: kernel='auto' keeps them off the
    kernel, with the reason), and each site's op carries the route; the path counters agree."""
    import sys

    sys.path.insert(0, "tests")
    from _tiny import tiny_llama

    import specontext_compile as sc

    decisions = []
    real = routes.decide

    def decide(query, key_cache, *args):
        assert isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor)
        decisions.append(real(query, key_cache, *args))
        return decisions[-1]

    monkeypatch.setattr(routes, "decide", decide)
    torch._dynamo.reset()
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options=dict(budget=16, sink_tokens=2,
                                                                               recent_window=4, inner="eager"))
    cache = sc.SpeContextCache(model.config, max_cache_len=128)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        forward(input_ids=ids, cache=cache, use_cache=True)
        forward(input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert decisions == [routes.Decision("gather", "kernel='auto' off CUDA")] * 2, decisions
    assert cache.path_counts()["gather_sites"] == 2


@pytest.mark.parametrize("change,route,reason", [
    (dict(spec=StepSpec(32, 32, kernel="torch")), "gather", "kernel='torch'"),
    (dict(covers=True, spec=StepSpec(256, 256, dense_shortcut=True, kernel="auto")), "dense", None),
    (dict(covers=True, variant=AttentionVariant(0.125, soft_cap=50.0),
          spec=StepSpec(256, 256, dense_shortcut=True, kernel="auto")), "kernel", None),
    (dict(mask=((1, 1, 1, 256), torch.bfloat16)), "gather", "mask"),
    (dict(mask=((1, 1, 4, 256), torch.bool), query=(1, 9, 4, 64)), "gather", "mask"),
    (dict(query=(1, 9, 20, 64)), "gather", "query rows"),
    (dict(query=(1, 9, 1, 2048), key=(1, 3, 256, 2048)), "gather", "head_dim"),
    (dict(device="cpu"), "gather", "off CUDA"),
    (dict(variant=AttentionVariant(0.125, soft_cap=50.0)), "kernel", None),
    (dict(variant=AttentionVariant(0.125, sliding_window=64)), "kernel", None),
    (dict(variant=AttentionVariant(0.125, soft_cap=50.0, sliding_window=64)), "kernel", None),
    (dict(mask=((1, 1, 1, 256), torch.bool)), "kernel", None),
    (dict(variant=AttentionVariant(0.125, nope_dim=32)), "gather", "MLA kernel"),
    (dict(variant=AttentionVariant(0.125, nope_dim=32), spec=StepSpec(32, 32, kernel="triton")), "kernel", None),
    (dict(spec=StepSpec(32, 32, kernel="auto", offload=True)), "offload", "KV offload"),
    (dict(covers=True, spec=StepSpec(256, 256, dense_shortcut=True, kernel="auto", offload=True)), "offload",
     "KV offload"),
    (dict(variant=AttentionVariant(0.125, nope_dim=32), spec=StepSpec(32, 32, kernel="triton", offload=True)),
     "kernel", None),
], ids=["kernel-torch", "dense-shortcut", "dense-needs-plain", "float-mask", "mask-rows", "q-len", "head-dim",
        "cpu-auto", "soft-cap", "sliding-window", "both", "bool-decode-mask", "mla-auto", "mla-triton",
        "offload", "offload-before-dense", "offload-keeps-mla-resident"])
def test_one_decision_per_site(change, route, reason):
    """:func:`routes.decide` on fake tensors: dense over the store where the selection covers it
    (plain sites only), the kernel where option ``kernel`` allows it and the kernel is exact
    (a soft cap, a sliding window and a one-row bool mask included: its own flags, a folded
    mask), else the gather path with the reason; with KV offload every non-MLA site gathers
    through the offload manager (``"offload"``), MLA sites are decided as without it."""
    site = list(_SITE)
    if "query" in change:
        site[0] = (change["query"], torch.bfloat16)
    if "key" in change:
        site[1] = (change["key"], torch.bfloat16)
    device = change.get("device", "cuda")
    query, key_cache = _fake(*site[:2], device=device)
    mask = _fake(change["mask"], device=device)[0] if "mask" in change else None
    spec = change.get("spec", StepSpec(32, 32, kernel="auto"))
    decision = routes.decide(query, key_cache, mask, change.get("covers", False), spec,
                             change.get("variant", AttentionVariant(0.125)))
    assert decision.route == route and (reason is None) == (decision.reason is None), decision
    assert reason is None or reason in decision.reason, decision


def test_triton_on_cpu_without_the_interpreter_is_refused_when_deciding(monkeypatch):
    """kernel='triton' on CPU tensors without ``TRITON_INTERPRET=1``: a clear error when the
    pass decides (before any step runs), naming the options that run here."""
    monkeypatch.delenv("TRITON_INTERPRET")
    query, key_cache = _fake(*_SITE[:2], device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*kernel='torch' or 'auto'"):
        routes.decide(query, key_cache, None, False, StepSpec(32, 32, kernel="triton"), AttentionVariant(0.125))


def test_the_dense_route_attends_over_the_store_and_refuses_a_selection_that_does_not_cover_it():
    """``route="dense"``: the torch body's exact attention over the whole store (float64 within
    1e-5); a spec with that route over a selection short of the store is refused (the pass never
    makes one), never a silently different attention."""
    query, key, value, _, length = _case(1, 6, 2, 64, 64, 50)
    indices = torch.arange(64).expand(1, 2, 64).contiguous()  # a slot for every store position
    spec, variant = StepSpec(64, 64, dense_shortcut=True, route="dense"), AttentionVariant(64 ** -0.5)
    out = aten_step.sparse_attention(query, key, value, indices, length, None, spec, variant)
    torch.testing.assert_close(out.double(), _float64(query, key, value, indices[..., :50].contiguous(), length),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="route='dense'"):
        aten_step.sparse_attention(query, key, value, indices[..., :40], length, None, spec, variant)


def _load_text(path, text: str):
    """A module from ``text``, written to ``path`` (Triton's ``@jit`` reads its source)."""
    import importlib.util

    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inductors_copy_of_the_kernels_resolves_every_name(monkeypatch, tmp_path):
    """Inside a compiled step inductor does not call our module's kernels: it copies each
    kernel and the jit functions it calls, by source, into a module of its own
    (``user_defined_triton_kernel_transitive_closure_source_code``). A helper that names a
    global the copy lacks compiles here and fails on the device (an H200 run of 2026-12-04:
    triton's ``_elementwise_max`` names triton's ``core``). ``codegen/kernels.py`` is loaded
    as it is on a GPU (no interpreter); every global each copied function reads must exist in
    the copy."""
    import builtins
    import dis

    from specontext_compile.codegen import kernel_module
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code,
    )
    from triton import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = kernel_module()
    for kernel in (module.sparse_decode_split_kernel, module.sparse_mla_split_kernel,
                   module.sparse_decode_merge_kernel):
        assert isinstance(kernel, JITFunction)
        copy = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        text = "import triton\nimport triton.language as tl\n" + copy
        namespace = vars(_load_text(tmp_path / f"copy_{kernel.__name__}.py", text))
        # inductor decorates the kernel itself; the functions it calls come decorated
        functions = [namespace[kernel.__name__]] + [v.fn for v in namespace.values() if isinstance(v, JITFunction)]
        assert len(functions) > 1
        for function in functions:
            missing = {i.argval for i in dis.Bytecode(function) if i.opname == "LOAD_GLOBAL"
                       and i.argval not in namespace and not hasattr(builtins, i.argval)}
            assert not missing, f"{function.__name__} reads {missing}, absent from inductor's copy"


class _Recorder:
    """Stands in for ``wrap_triton``: records each launch's keyword arguments instead."""

    launches: list = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((self.kernel, kwargs))


def _inductor_signature(kernel, kwargs) -> tuple[dict, dict]:
    """The argument types inductor gives a user kernel on CUDA: tensors as pointers, ints as
    i64, Python floats as fp64 (``triton_utils.signature_of``); constexprs as they are."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64"}
    signature, constants = {}, {}
    for param in kernel.params:
        value = kwargs[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + names[value.dtype]
        else:
            signature[param.name] = "fp64" if isinstance(value, float) else "i64"
    return signature, constants


@pytest.mark.parametrize("spec", [dict(dtype="fp32", group=3), dict(dtype="bf16", group=4, head_dim=128),
                                  dict(dtype="fp16", group=2, soft_cap=True, sliding_window=True),
                                  dict(dtype="bf16", group=4, head_dim=64, rope_dim=16)],
                         ids=["fp32", "bf16", "fp16-softcap-window", "mla"])
def test_the_kernels_compile_with_the_argument_types_inductor_gives_them(monkeypatch, spec):
    """Triton's front end (source to TTIR, for an sm_90 target; no GPU needed) accepts each
    kernel (MLA's too) with the types inductor passes: a Python float is fp64 there, not fp32
    as in a direct launch. The H200 run of 2026-12-04 failed on it ("loop-carried variable
    m_i ... re-assigned to fp64"): the kernels now cast their float arguments to fp32."""
    from specontext_compile.codegen.launch import launch
    from specontext_compile.codegen.spec import KernelSpec
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard.sum, InterpretedFunction):  # DRY=1 scripts/gpu_check.sh: the whole run interprets
        pytest.skip("triton.language was imported under TRITON_INTERPRET=1: its own jit functions are "
                    "interpreted, and the compiler's front end cannot take them in this process")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = KernelSpec(**spec)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    heads, d = spec.group, spec.head_dim
    query, key, value = (torch.zeros(1, h, n, d, dtype=dtype) for h, n in ((heads, 1), (1, 100), (1, 100)))
    tensors = (query, key, value)
    if spec.is_mla:  # (query, query_rope, latent store, rope store); the latent is the value
        tensors = (query, torch.zeros(1, heads, 1, spec.rope_dim, dtype=dtype), key,
                   torch.zeros(1, 1, 100, spec.rope_dim, dtype=dtype))
    out, part_out, part_lse = (torch.zeros(s) for s in ((1, heads, 1, d), (1, heads, 1, 2, d), (1, heads, 1, 2)))
    _Recorder.launches = []
    launch(spec, tensors, torch.arange(40).view(1, 1, 40), torch.tensor([50]), out.to(dtype),
           part_out, part_lse, scale=d ** -0.5, soft_cap=30.0, window=64, split_size=32, num_splits=2,
           wrap=_Recorder)
    split = "sparse_mla_split_kernel" if spec.is_mla else "sparse_decode_split_kernel"
    assert [k.__name__ for k, _ in _Recorder.launches] == [split, "sparse_decode_merge_kernel"]
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    for kernel, kwargs in _Recorder.launches:
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        source = ASTSource(kernel, *_inductor_signature(kernel, kwargs))
        ttir = source.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), context)
        assert kernel.__name__ in str(ttir)


def _device_error(name: str = "sparse_decode_split_kernel"):
    """The error inductor raised on the H200 (docs/results/gpu_pytest_h200_2026-12-04_run5.log), shortened:
    the kernel's name and the cause come lines after the first."""
    from torch._inductor.compile_worker.subproc_pool import SubprocException
    from torch._inductor.exc import InductorError

    details = ("Traceback (most recent call last):\n  File \"triton/compiler/compiler.py\", line 80, in make_ir\n"
               "triton.compiler.errors.CompilationError: at 58:4:\n    for n0 in range(start, end, BLOCK_N):\n"
               "    ^\nAssertionError(\"Loop-carried variable m_i has initial type <['16'], fp32> but is "
               "re-assigned to <['16'], fp64> in loop!\")")
    return InductorError(SubprocException(details).with_name(name), None)


def _tiny_llama(layers: int):
    import sys

    sys.path.insert(0, "tests")
    from _tiny import tiny_llama

    return tiny_llama(layers=layers)


def _kernel_compile_fails(monkeypatch, error: Exception) -> tuple[list, list]:
    """On CPU: the lowering sends every ``kernel="auto"`` decode site to the generated kernel,
    and inductor's compile of a graph holding such a site raises ``error``. Returns the lists
    of every graph given to inductor and of those that raised."""
    import torch._inductor.compile_fx as compile_fx_module

    from specontext_compile import backend

    graphs, failed = [], []
    real_compile = compile_fx_module.compile_fx

    def compile_fx(gm, inputs, **kwargs):
        graphs.append(gm)
        if any(n.target is kernel_step.kernel_attention for n in gm.graph.nodes):
            failed.append(gm)
            raise error
        return real_compile(gm, inputs, **kwargs)

    monkeypatch.setattr(backend, "_may_take_kernel", lambda on_cuda: True)
    monkeypatch.setattr(routes, "decide", lambda query, key_cache, mask, covers, spec, variant:
                        routes.Decision("kernel" if spec.kernel == "auto" else "gather"))
    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    return graphs, failed


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_a_kernel_inductor_cannot_compile_falls_back_to_the_torch_body(monkeypatch, caplog):
    """When inductor fails to compile a graph whose sites take the generated kernel (as on an
    H200 twice, 2026-12-04), the backend lowers the graph again with those sites on the torch
    body and compiles that, with a warning naming the error and a counter: the model runs,
    with the logits of a step that never tried the kernel. On CPU: the lowering is made to
    send every decode site to the kernel, and inductor's compile of a graph holding a kernel
    site raises the device's error."""
    import logging

    from torch._dynamo.utils import counters

    import specontext_compile as sc

    graphs, failed = _kernel_compile_fails(monkeypatch, _device_error())
    model = _tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    logits, ops_lowered, fallbacks = [], [], []
    for options in (dict(kernel="torch"), dict()):
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model.forward, backend="specontext",
                                options=dict(budget=16, sink_tokens=2, recent_window=4, regional=False, **options))
        cache = sc.SpeContextCache(model.config, max_cache_len=128)
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="specontext_compile.backend"):
            forward(input_ids=ids, cache=cache, use_cache=True)
            logits.append(forward(input_ids=ids[:, :1], cache=cache, use_cache=True).logits)
        assert cache.path_counts()["gather_sites"] == 2
        ops_lowered.append(counters["specontext"]["ops_lowered"])
        fallbacks.append(counters["specontext"]["kernel_compile_fallbacks"])
        assert counters["specontext"]["kernel_sites_lowered"] == 0
    assert len(failed) == 1 and fallbacks == [0, 1]  # the decode graph of the default options, once
    assert ops_lowered[0] == ops_lowered[1] > 0  # the failed lowering is not counted
    assert "could not compile the generated attention kernel" in caplog.text
    assert "Loop-carried variable" in caplog.text  # the cause, not only the error's first line
    after = graphs[graphs.index(failed[0]) + 1:]
    assert after and not any(n.target is kernel_step.kernel_attention for g in after for n in g.graph.nodes)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_a_compile_error_that_is_not_our_kernels_is_raised_as_it_is(monkeypatch):
    """Only an error that names our generated kernels is remedied by leaving them out; any
    other inductor failure of a graph with kernel sites propagates, without a second compile."""
    from torch._dynamo.utils import counters

    import specontext_compile as sc

    _, calls = _kernel_compile_fails(monkeypatch, _device_error(name="triton_poi_fused_add_0"))  # inductor's own
    torch._dynamo.reset()
    counters.clear()
    model = _tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext",
                            options=dict(budget=16, sink_tokens=2, recent_window=4, regional=False))
    cache = sc.SpeContextCache(model.config, max_cache_len=128)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(Exception, match="triton_poi_fused_add_0"):
        forward(input_ids=ids, cache=cache, use_cache=True)
        forward(input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert len(calls) == 1 and counters["specontext"]["kernel_compile_fallbacks"] == 0


def test_the_compiled_graph_keeps_dynamos_input_metadata_for_cuda_graphs(monkeypatch):
    """CUDA graphs skip a graph that writes an input unless AOTAutograd knows the input keeps
    its address; it reads that from dynamo's graph (``_param_name_to_source``, each
    placeholder's ``_dynamo_source`` and ``tensor_dict``). The H200 runs of 2026-12-04 logged
    "skipping cudagraphs due to mutated inputs (45 instances)" for every specontext graph: our
    copy of the graph had dropped that metadata. Here on CPU (where the stores are not marked
    static by the cache, the test marks them): the graph inductor receives carries the
    metadata, the stores' inputs and the inputs our passes added (the path counters) are
    static, as the weights are, and nothing else is."""
    import sys

    import torch._inductor.compile_fx as compile_fx_module
    from torch._functorch._aot_autograd.frontend_utils import _try_get_metadata_from_dynamo

    sys.path.insert(0, "tests")
    from _tiny import tiny_llama

    import specontext_compile as sc

    graphs = []
    real_compile = compile_fx_module.compile_fx

    def compile_fx(gm, inputs, **kwargs):
        graphs.append(gm)
        return real_compile(gm, inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    torch._dynamo.reset()
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext",
                            options=dict(budget=16, sink_tokens=2, recent_window=4, regional=False))
    cache = sc.SpeContextCache(model.config, max_cache_len=128)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # eager prefill allocates the stores
        stores = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        for t in stores:
            torch._dynamo.mark_static_address(t, guard=False)
        forward(input_ids=ids[:, :1], cache=cache, use_cache=True)
    gm = graphs[0]  # the decode step's graph (the eager prefill compiled nothing)
    assert any(n.target is aten_step.refine_and_attend for n in gm.graph.nodes), len(graphs)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources, static = _try_get_metadata_from_dynamo(gm, {}.keys(), len(placeholders), [])
    assert sources is not None, "AOTAutograd did not recognise the graph as dynamo's"
    names = [str(getattr(n, "_dynamo_source", None)) for n in placeholders]
    stored = [i for i, name in enumerate(names) if name.endswith(("member='keys')", "member='values')"))]
    added = [i for i, n in enumerate(placeholders) if n._dynamo_source is None]
    assert len(stored) == len(stores) and added, (names, added)
    assert set(stored) | set(added) <= set(static), [names[i] for i in static]
    weights = {i for i, name in enumerate(names) if "'_parameters')" in name or "'_buffers')" in name}
    assert set(static) == set(stored) | set(added) | weights  # nothing else (a step's token, ...)
